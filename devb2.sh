set -o pipefail
echo "== tests"; timeout 200 python3 benchmarks/dev_gpu_tests.py 12 tests/test_gpu_sm80.py -k "fp8 or kvcache or paged" 2>&1 | tail -4 | tee $OUT/tests.log
echo "== sanitizer"; timeout 200 python3 tests/gpu_sanitize.py --groups portable --cases portable_decode_fp8 --tool all --jobs 4 --out $OUT/san 2>&1 | tail -9
echo "== fp8kv"; timeout 200 python3 -m cuteattn.bench --decode --fp8-kv --json $OUT/2026-12-02-cc6c8ea-h200-decode-fp8kv.json --commit cc6c8ea 2>&1 | tail -40
echo '== bf16'; timeout 160 python3 -m cuteattn.bench --decode --json $OUT/2026-12-02-cc6c8ea-h200-decode.json --commit cc6c8ea 2>&1 | tail -30
