# Sourced by the GPU scripts (run from the repository root): the repository first on PYTHONPATH,
# and the carried wheels (.whl/: pyzmq, msgspec, which the GPU image lacks) installed if any.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/zllm-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/zllm-site"
fi
