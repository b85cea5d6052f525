"""Client lifecycle: an AsyncClient or Client never hangs its process — dropped unclosed (collected
after its loop closed, in another loop, in its own running loop, or at interpreter exit), with
its event loop closed under it, shared by tasks or threads and closed under them, or with the
server gone. Every case runs in a child interpreter under a timeout: a hang fails the test."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # the `server` fixture serves the real SmolLM2 model

# Imported by every case: a short request, a long one (aborted by leaving or closing), and the
# open file descriptors of the process (sockets included).
PRELUDE = textwrap.dedent("""
    import asyncio, gc, os, sys, threading, time
    from zllm import AsyncClient, Client, SamplingParams
    from zllm.client import ClientClosedError, ServerGoneError
    ENDPOINT = sys.argv[1]
    SHORT = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    LONG = SamplingParams(max_tokens=4000, ignore_eos=True)

    def open_fds():
        return len(os.listdir("/proc/self/fd"))
""")


def run_case(code: str, endpoint: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run PRELUDE + code in a fresh interpreter (ResourceWarnings shown); fail on a hang or error."""
    command = [
        sys.executable,
        "-X",
        "faulthandler",
        "-W",
        "always::ResourceWarning",
        "-c",
        PRELUDE + textwrap.dedent(code),
        endpoint,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the process hung (killed after {timeout:.0f} s); output:\n{hung.stdout}\n{hung.stderr}")
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "OK" in done.stdout, done.stdout + done.stderr
    return done


def test_async_client_dropped_after_its_loop_closed_is_collected(server):
    """The reported hang: gc.collect() after asyncio.run() left an unclosed client behind."""
    done = run_case(
        """
        async def main():
            client = AsyncClient(ENDPOINT)
            async for _ in client.stream("Hi", SHORT):
                pass
        asyncio.run(main())
        gc.collect()
        print("OK")
    """,
        server.endpoint,
    )
    assert "ResourceWarning: unclosed <AsyncClient" in done.stderr


def test_async_client_collected_in_another_loop(server):
    run_case(
        """
        async def use_and_drop():
            client = AsyncClient(ENDPOINT)
            cycle = [client]
            cycle.append(cycle)  # only the collector can free it
            await client.generate("Hi", SHORT)

        async def collect_then_use_a_new_client():
            gc.collect()
            async with AsyncClient(ENDPOINT) as client:
                await client.generate("Hi", SHORT)

        asyncio.run(use_and_drop())
        asyncio.run(collect_then_use_a_new_client())
        print("OK")
    """,
        server.endpoint,
    )


def test_async_clients_dropped_in_their_running_loop_give_back_their_sockets(server):
    run_case(
        """
        async def main():
            await AsyncClient(ENDPOINT).generate("Hi", SHORT)  # the first client loads what stays
            gc.collect()
            await asyncio.sleep(0.2)
            baseline = open_fds()
            for _ in range(10):
                client = AsyncClient(ENDPOINT)
                async for _ in client.stream("Hi", SHORT):
                    pass
                del client
            gc.collect()
            await asyncio.sleep(0.5)  # the sockets close on the loop's own thread
            left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("zllm-client")]
            assert not left, left
            assert open_fds() <= baseline + 1, (baseline, open_fds())
        asyncio.run(main())
        print("OK")
    """,
        server.endpoint,
    )


def test_unclosed_clients_at_interpreter_exit(server):
    """A global AsyncClient and a Client whose stream is still being read by a thread at exit."""
    run_case(
        """
        async_client = AsyncClient(ENDPOINT)
        async def first_token():
            async for _ in async_client.stream("Count:", LONG):
                return
        asyncio.run(first_token())

        client = Client(ENDPOINT)
        started = threading.Event()
        def read_forever():
            for _ in client.stream("Count:", LONG):
                started.set()
        threading.Thread(target=read_forever, daemon=True).start()
        assert started.wait(30)
        print("OK")
    """,
        server.endpoint,
    )


def test_async_client_outlives_its_event_loop(server):
    """Used from one asyncio.run after another (its loop closed under it), then closed from a
    third loop; calls after close fail at once."""
    run_case(
        """
        client = AsyncClient(ENDPOINT)
        async def ask():
            return (await client.generate("Hi", SHORT)).outputs[0].token_ids
        first = asyncio.run(ask())
        assert asyncio.run(ask()) == first

        async def leave_a_stream_open():  # the loop closes with the stream half read
            stream = client.stream("Count:", LONG)
            await stream.__anext__()
        asyncio.run(leave_a_stream_open())

        async def close_twice_then_call():
            await client.close()
            await client.close()
            try:
                await client.generate("Hi", SHORT)
            except ClientClosedError:
                return
            raise AssertionError("a closed client answered")
        asyncio.run(close_twice_then_call())
        print("OK")
    """,
        server.endpoint,
    )


def test_async_client_shared_by_tasks_and_closed_under_them(server):
    run_case(
        """
        async def main():
            async with AsyncClient(ENDPOINT) as client:
                outputs = await asyncio.gather(*[client.generate(f"Fact {i}:", SHORT) for i in range(6)])
                assert all(len(out.outputs[0].token_ids) == 2 for out in outputs)

            client = AsyncClient(ENDPOINT)
            started = asyncio.Semaphore(0)
            async def read_long():
                try:
                    async for _ in client.stream("Count:", LONG):
                        started.release()
                except ClientClosedError:
                    return "closed"
            readers = [asyncio.create_task(read_long()) for _ in range(4)]
            for _ in range(4):
                await started.acquire()
            began = time.monotonic()
            await client.close()
            assert await asyncio.gather(*readers) == ["closed"] * 4
            assert time.monotonic() - began < 5
            stats = AsyncClient(ENDPOINT)
            for _ in range(100):  # the close aborted the 4 requests on the server
                if (await stats.stats())["num_running"] == 0:
                    break
                await asyncio.sleep(0.1)
            assert (await stats.stats())["num_running"] == 0
            await stats.close()
        asyncio.run(main())
        print("OK")
    """,
        server.endpoint,
    )


def test_client_shared_by_threads_and_closed_under_them(server):
    run_case(
        """
        from concurrent.futures import ThreadPoolExecutor
        with Client(ENDPOINT) as client:
            with ThreadPoolExecutor(8) as pool:
                outputs = list(pool.map(lambda i: client.generate(f"Fact {i}:", SHORT), range(8)))
            assert all(len(out.outputs[0].token_ids) == 2 for out in outputs)

        client = Client(ENDPOINT)
        results, started = [], threading.Semaphore(0)
        def read_long():
            try:
                for _ in client.stream("Count:", LONG):
                    started.release()
            except ClientClosedError:
                results.append("closed")
        threads = [threading.Thread(target=read_long) for _ in range(4)]
        for thread in threads:
            thread.start()
        for _ in range(4):
            assert started.acquire(timeout=30)
        client.close()
        for thread in threads:
            thread.join(10)
        assert results == ["closed"] * 4, results
        assert threading.active_count() == 1, threading.enumerate()
        print("OK")
    """,
        server.endpoint,
    )


def test_dropped_clients_stop_their_threads(server):
    done = run_case(
        """
        for _ in range(5):
            client = Client(ENDPOINT)
            client.generate("Hi", SHORT)
            del client
            gc.collect()
        for _ in range(50):
            if threading.active_count() == 1:
                break
            time.sleep(0.1)
        assert threading.active_count() == 1, threading.enumerate()
        print("OK")
    """,
        server.endpoint,
    )
    assert "ResourceWarning: unclosed <Client" in done.stderr
    assert "unclosed <AsyncClient" not in done.stderr  # one warning per dropped client


def test_clients_of_a_server_that_is_not_there(tmp_path):
    run_case(
        """
        began = time.monotonic()
        async def main():
            client = AsyncClient(ENDPOINT, timeout=1.0, heartbeat_interval=0.2)
            try:
                await client.generate("Hi", SHORT)
            except ServerGoneError:
                pass
            await client.close()
            AsyncClient(ENDPOINT, timeout=1.0).stream("Hi", SHORT)  # dropped before use
        asyncio.run(main())
        with Client(ENDPOINT, timeout=1.0, heartbeat_interval=0.2) as client:
            try:
                client.generate("Hi", SHORT)
            except ServerGoneError:
                pass
        dropped = Client(ENDPOINT, timeout=1.0)
        gc.collect()
        assert time.monotonic() - began < 15
        print("OK")
    """,
        f"ipc://{tmp_path}/nobody.sock",
    )


def test_client_of_a_server_that_dies_mid_stream(tmp_path):
    """A stand-in server answers one delta and disappears: the stream fails with
    ServerGoneError after `timeout`, and closing and exiting do not wait for the server."""
    run_case(
        """
        import zmq
        from zllm.ipc.codec import Codec
        from zllm.ipc.messages import ClientToServer, ServerOutput, ServerToClient

        def serve_one_delta_then_vanish():
            context = zmq.Context()
            router = context.socket(zmq.ROUTER)
            router.bind(ENDPOINT)
            identity, frame = router.recv_multipart()
            request = Codec(ClientToServer).decode(frame)
            delta = ServerOutput(request.request_id, text="a", token_ids=[1], prompt_token_ids=[1])
            router.send_multipart([identity, Codec(ServerToClient).encode(delta)])
            router.close(linger=0)
            context.term()
        server = threading.Thread(target=serve_one_delta_then_vanish)
        server.start()

        client = Client(ENDPOINT, timeout=1.0, heartbeat_interval=0.2)
        received = []
        try:
            for delta in client.stream("Hi", LONG):
                received.append(delta)
        except ServerGoneError:
            pass
        assert len(received) == 1
        server.join()
        began = time.monotonic()
        client.close()
        assert time.monotonic() - began < 2
        print("OK")
    """,
        f"ipc://{tmp_path}/dies.sock",
    )
