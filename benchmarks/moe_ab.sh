# A/B of the MoE layer on the device machine: the kernels of this tree ("new") against another tree's ("base"),
# in one call, TorchTitan 0.3.0 in every layer process.
#
#   export K3_SOURCE_COMMIT=<HEAD here> && . benchmarks/device_env.sh && bash benchmarks/moe_ab.sh .ab/base
#
# .ab/base holds the base kernels (`mkdir -p .ab/base && git archive <commit> kernels | tar -x -C .ab/base`; carry
# .ab and .whl). Optional environment:
#   AB_PASSES=1         first the FP8 quantisation passes at 112 experts x 32K tokens, base then new
#   AB_PASS_SETTINGS    their program sizes (benchmarks/moe.py --pass-settings; default: the kernels' own)
#   AB_PASS_SETTING     the layer processes' pass program sizes, both trees (--pass-setting; default: their own)
#   AB_TOKENS           the layer points (default 16384,4096,32768)
#   AB_UNTIL=430        start no layer process after this many seconds of the call (they alternate new, base, ...)
#   AB_LAYERS=6         at most this many layer processes
#   AB_BIT_TEST=1       at the end, the Gluon-vs-Triton FP8 bit test on the new kernels
# Everything lands in $OUT/r and is packed into $OUT/moe_ab.tar.gz after each step (the device returns at most 8
# files, and nothing from a step killed at the call's limit); then, here:
#   python -m benchmarks.moe_processes --out benchmarks/results/<name>.json --what "..." base=r/layer_2_base.json ...
set -u
R=$OUT/r
mkdir -p "$R" /tmp/k3k_ab_base
ln -sfn "$(cd "$1" && pwd)/kernels" /tmp/k3k_ab_base/k3_kernels
NEW="/tmp/site:$PWD:/tmp/k3k"
BASE="/tmp/site:$PWD:/tmp/k3k_ab_base"
pack() { tar -czf "$OUT/moe_ab.tar.gz" -C "$OUT" r; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$R/gpu.txt"
if [ "${AB_PASSES:-0}" = 1 ]; then
  for v in base new; do
    P=$BASE; [ $v = new ] && P=$NEW
    S=(); [ -n "${AB_PASS_SETTINGS:-}" ] && S=(--pass-settings "$AB_PASS_SETTINGS")
    echo "== passes $v"
    PYTHONPATH=$P timeout 120 python3 -m benchmarks.moe --gluon-gemms 112,32768 --gemms passes --experts '' \
      --fp8-tiles '' "${S[@]}" --rep-ms 500 --out "$R/passes_$v.json" > "$R/passes_$v.log" 2>&1
    grep "^passes" "$R/passes_$v.log" | cut -c1-300
    pack
  done
fi
i=0
while [ $i -lt "${AB_LAYERS:-6}" ] && [ $SECONDS -lt "${AB_UNTIL:-430}" ]; do
  i=$((i + 1)); v=new; P=$NEW
  [ $((i % 2)) = 0 ] && v=base && P=$BASE
  echo "== layer $i $v"
  S=(); [ -n "${AB_PASS_SETTING:-}" ] && S=(--pass-setting "$AB_PASS_SETTING")
  PYTHONPATH=$P timeout 120 python3 -m benchmarks.moe --experts 112 --tokens "${AB_TOKENS:-16384,4096,32768}" \
    --impls torchtitan,ours_fp8_full --rep-ms 1000 "${S[@]}" --out "$R/layer_${i}_$v.json" > "$R/layer_${i}_$v.log" 2>&1
  grep "E=112" "$R/layer_${i}_$v.log"
  pack
done
if [ "${AB_BIT_TEST:-0}" = 1 ]; then
  echo "== bit test (new)"
  PYTHONPATH=$NEW timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_moe_fp8_grad.py \
    -k "either_gemm and (change1 or change5)" > "$R/bit_test.txt" 2>&1
  tail -2 "$R/bit_test.txt"
  pack
fi
