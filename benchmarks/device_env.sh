# Source this on the device machine before a benchmark: `. benchmarks/device_env.sh && python3 -m benchmarks.kda_ab ...`
# The machine has torch and triton but no virtual environment and no network: fla-core (the baseline) travels as
# wheels in .whl/ (ignored by git; name it in the device call's `carry`), fetched here once with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl fla-core==0.6.0 einops
# The device's copy of the tree carries a stale .git: start the call with `export K3_SOURCE_COMMIT=<git rev-parse
# HEAD, taken here>` so the results name the commit measured (benchmarks/_results.py).
# It installs them into /tmp/site and makes kernels/ importable as k3_kernels.
# K3_KEEP_TRITON_CACHE=1 keeps Triton's autotuning results across calls (fla-core's cold autotuning ate most of
# several calls): Triton writes each tuned kernel's timings as <cache>/<key>/<kernel>.autotune.json
# (TRITON_CACHE_AUTOTUNING=1 for our kernels; fla-core asks for it itself, FLA_CACHE_RESULTS). Only those files are
# packed, into $OUT/triton_autotune.tar.gz when the calling shell exits (the whole cache is thousands of files, over
# the tool's count limit). Copy it to .triton_cache/ here and carry that folder: the next call unpacks it and
# compiles only each kernel's chosen config. A call killed at its limit packs nothing.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/k3k && ln -sfn "$PWD/kernels" /tmp/k3k/k3_kernels
export PYTHONPATH="/tmp/site:$PWD:/tmp/k3k" PYTHONUNBUFFERED=1
if [ "${K3_KEEP_TRITON_CACHE:-0}" = 1 ] && [ -n "${OUT:-}" ]; then
    export TRITON_CACHE_DIR=/tmp/triton_cache TRITON_CACHE_AUTOTUNING=1
    mkdir -p "$TRITON_CACHE_DIR"
    [ -f .triton_cache/triton_autotune.tar.gz ] && tar -xzf .triton_cache/triton_autotune.tar.gz -C "$TRITON_CACHE_DIR"
    trap '(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar -czf "$OUT/triton_autotune.tar.gz" -T -)' EXIT
fi
# K3_KEEP_TRITON_CACHE=all keeps the compiled kernels themselves, for runs whose first minutes are compilation
# rather than autotuning (our kernels do not autotune: benchmarks/spec_decode.py's first SFT step, ~120 s, is
# mostly compiling the model's Triton kernels). The whole cache is packed into $OUT/triton_cache_all.tar.gz (one
# file; it comes back only under the tool's per-file limit, 16 MiB); carry it back as
# .triton_cache/triton_cache_all.tar.gz. Same GPU, driver and Triton on the next machine: the cache keys match.
if [ "${K3_KEEP_TRITON_CACHE:-0}" = all ] && [ -n "${OUT:-}" ]; then
    export TRITON_CACHE_DIR=/tmp/triton_cache
    mkdir -p "$TRITON_CACHE_DIR"
    [ -f .triton_cache/triton_cache_all.tar.gz ] && tar -xzf .triton_cache/triton_cache_all.tar.gz -C "$TRITON_CACHE_DIR"
    trap '(cd "$TRITON_CACHE_DIR" && tar -czf "$OUT/triton_cache_all.tar.gz" .)' EXIT
fi
