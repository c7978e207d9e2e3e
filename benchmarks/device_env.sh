# Source this on the device machine before a benchmark: `. benchmarks/device_env.sh && python3 -m benchmarks.kda_ab ...`
# The machine has torch and triton but no virtual environment and no network: fla-core (the baseline) travels as
# wheels in .whl/ (ignored by git; name it in the device call's `carry`), fetched here once with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl fla-core==0.6.0 einops
# The device's copy of the tree carries a stale .git: start the call with `export K3_SOURCE_COMMIT=<git rev-parse
# HEAD, taken here>` so the results name the commit measured (benchmarks/_results.py).
# It installs them into /tmp/site, makes kernels/ importable as k3_kernels, and keeps the Triton cache under $OUT
# when K3_KEEP_TRITON_CACHE=1 (it then comes back with the call's files: carry it next time to skip cold builds).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/k3k && ln -sfn "$PWD/kernels" /tmp/k3k/k3_kernels
export PYTHONPATH="/tmp/site:$PWD:/tmp/k3k" PYTHONUNBUFFERED=1
if [ "${K3_KEEP_TRITON_CACHE:-0}" = 1 ] && [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/triton_cache"
    [ -d .triton_cache ] && cp -r .triton_cache/. "$OUT/triton_cache/"
    export TRITON_CACHE_DIR="$OUT/triton_cache"
fi
