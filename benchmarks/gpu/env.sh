# Sourced by the GPU scripts (run from the repository root): the repository first on PYTHONPATH,
# and the carried wheels (.whl/: pyzmq, msgspec, xgrammar and its needs, which the GPU image lacks;
# run_all.sh's header says how to make them) installed if any.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/zllm-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/zllm-site"
fi
missing=$(python3 -c 'import importlib.util as u; print(*(m for m in ("zmq", "msgspec", "xgrammar") if u.find_spec(m) is None))')
[ -z "$missing" ] || echo "WARNING: cannot import $missing: carry .whl/ (benchmarks/gpu/run_all.sh's header)" >&2
