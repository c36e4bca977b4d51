date +%T
timeout 200 python3 benchmarks/dev_gpu_tests.py 15 tests/test_gpu_fallbacks.py tests/test_gpu_kv_append.py tests/test_gpu_sm80.py -k "fallback or kv_append or kvcache" 2>&1 | grep -v " passed\|^$" | tail -15
date +%T
timeout 100 python3 tests/gpu_sanitize.py --groups portable --cases portable_decode5,portable_kv_append --tool racecheck --out $OUT/san 2>&1 | tail -4
date +%T
C=dfb642d
timeout 130 python3 -m cuteattn.bench --decode --json $OUT/decode.json --commit $C 2>&1 | tail -22
date +%T
timeout 130 python3 -m cuteattn.bench --decode --fp8-kv --json $OUT/decode-fp8kv.json --commit $C 2>&1 | tail -16
date +%T
