"""Run vLLM's own serving benchmark client, unmodified, against a running `vllm-launch`.

vLLM's code is never part of this repository: the script takes the vllm 0.6.3.post1 source
distribution (2.7 MB) from, in this order, --sdist, the repository's git-ignored `.sdist/` folder,
or the package index at run time, checks its SHA-256 against the one pinned here (and, when it
downloads, against the index's too), extracts only `benchmarks/benchmark_serving.py` and
`benchmarks/backend_request_func.py` into a temporary directory, puts a stand-in `datasets`
module beside them (the client imports it at the top, but the random dataset never calls it), and
runs

    python benchmark_serving.py --backend openai --dataset-name random <your arguments>

in the caller's working directory (so relative --result-dir and --tokenizer paths work; the
--result-dir is created). It exits non-zero unless every request succeeded.

    python benchmarks/vllm_benchmark_serving.py --base-url http://127.0.0.1:8000 \\
        --model SmolLM2-135M-Instruct --tokenizer ~/.cache/zllm/models/SmolLM2-135M-Instruct \\
        --num-prompts 8 --random-input-len 32 --random-output-len 16 [--sdist vllm-0.6.3.post1.tar.gz]

For a machine without a network (the GPU machines), download the sdist into `.sdist/` once:

    python benchmarks/vllm_benchmark_serving.py --download-only

and carry `.sdist` with the working tree. Besides the standard library the client imports
aiohttp, numpy, tqdm, transformers, huggingface_hub and Pillow (PIL: a dependency of matplotlib;
no stand-in, as transformers would take one for the real thing); the script checks that they
import before it starts.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.6.3.post1"
SDIST = f"vllm-{VERSION}.tar.gz"
# The index's SHA-256 of SDIST (https://pypi.org/simple/vllm/), pinned so that an sdist carried
# to a machine without a network is checked too.
SDIST_SHA256 = "0aae6ddd5348f86bf20e4f323c09e77d5ad2638d77f0d69323c5a63a40f8c143"
LOCAL_SDIST = Path(__file__).resolve().parent.parent / ".sdist" / SDIST
SIMPLE_INDEX = "https://pypi.org/simple/vllm/"
CLIENT_FILES = ("benchmark_serving.py", "backend_request_func.py")
CLIENT_NEEDS = ("aiohttp", "numpy", "tqdm", "transformers", "huggingface_hub", "PIL")
DATASETS_STUB = '''"""Stand-in for Hugging Face `datasets`: benchmark_serving.py imports it at the top, but only
its hub datasets call it; zllm's runs use --dataset-name random."""


def load_dataset(*args, **kwargs):
    raise RuntimeError("datasets is not installed here: use --dataset-name random")
'''


def index_entry() -> dict:
    """The sdist's entry on the index's simple page (PEP 691 JSON): its URL and SHA-256."""
    request = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    for entry in files:
        if entry["filename"] == SDIST:
            return entry
    raise SystemExit(f"{SDIST} is not listed on {SIMPLE_INDEX}")


def fetch_sdist(directory: Path) -> Path:
    entry = index_entry()
    path = directory / SDIST
    print(f"downloading {entry['url']}", file=sys.stderr)
    with urllib.request.urlopen(entry["url"], timeout=300) as response:
        path.write_bytes(response.read())
    check_sha256(path, entry["hashes"]["sha256"])
    check_sha256(path, SDIST_SHA256)
    return path


def check_sha256(path: Path, expected: str) -> None:
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != expected:
        raise SystemExit(f"{path}: SHA-256 {actual} is not the expected {expected}")


def extract_client(sdist: Path, directory: Path) -> Path:
    """Only the two client files, into `directory`, plus the datasets stand-in."""
    with tarfile.open(sdist) as archive:
        for name in CLIENT_FILES:
            member = archive.getmember(f"vllm-{VERSION}/benchmarks/{name}")
            source = archive.extractfile(member)
            (directory / name).write_bytes(source.read())
    (directory / "datasets.py").write_text(DATASETS_STUB)
    return directory / "benchmark_serving.py"


def missing_modules() -> list[str]:
    return [name for name in CLIENT_NEEDS if importlib.util.find_spec(name) is None]


def run_client(script: Path, arguments: list[str]) -> tuple[int, str]:
    # The script's own directory comes first on its sys.path (Python puts it there), so the
    # datasets stand-in is found there whatever the working directory.
    command = [sys.executable, str(script), "--backend", "openai", "--dataset-name", "random", *arguments]
    print("running:", " ".join(command), file=sys.stderr)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        sys.stdout.write(line)
        lines.append(line)
    return process.wait(), "".join(lines)


def make_result_dir(arguments: list[str]) -> None:
    """The client writes --save-result's file into --result-dir but does not create it."""
    for i, argument in enumerate(arguments):
        if argument == "--result-dir" and i + 1 < len(arguments):
            Path(arguments[i + 1]).mkdir(parents=True, exist_ok=True)
        elif argument.startswith("--result-dir="):
            Path(argument.partition("=")[2]).mkdir(parents=True, exist_ok=True)


def all_successful(output: str, arguments: list[str]) -> bool:
    wanted = re.search(r"--num-prompts[= ](\d+)", " ".join(arguments))
    done = re.search(r"Successful requests:\s+(\d+)", output)
    return done is not None and int(done.group(1)) == int(wanted.group(1) if wanted else 1000)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Other arguments go to benchmark_serving.py unchanged."
    )
    parser.add_argument(
        "--sdist", type=Path, default=None, help=f"an already downloaded {SDIST} (default: {LOCAL_SDIST} if present)"
    )
    parser.add_argument(
        "--download-only", action="store_true", help=f"download {SDIST} into {LOCAL_SDIST.parent}/ and exit"
    )
    args, client_arguments = parser.parse_known_args()
    if args.download_only:
        LOCAL_SDIST.parent.mkdir(exist_ok=True)
        print(fetch_sdist(LOCAL_SDIST.parent))
        return
    missing = missing_modules()
    if missing:
        raise SystemExit(f"vLLM's client needs {', '.join(missing)}: not importable here")
    sdist = args.sdist if args.sdist is not None else LOCAL_SDIST if LOCAL_SDIST.is_file() else None
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        directory = Path(tmp)
        if sdist is None:
            sdist = fetch_sdist(directory)
        elif not sdist.is_file():
            raise SystemExit(f"--sdist: no such file {sdist}")
        else:
            check_sha256(sdist, SDIST_SHA256)
        make_result_dir(client_arguments)
        code, output = run_client(extract_client(sdist, directory), client_arguments)
    if code != 0 or not all_successful(output, client_arguments):
        raise SystemExit(f"benchmark_serving.py: exit code {code}, not every request successful")


if __name__ == "__main__":
    main()
