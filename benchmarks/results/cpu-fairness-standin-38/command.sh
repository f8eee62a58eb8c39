# from the repo root; OUT and LOGS: any two folders (issue 38 goal A and the new phases, on the stand-in)
export PATH=$PWD/tests/bin:$PATH FAKE_VLLM_PYTHON=$PWD/.venv/bin/python FAKE_VLLM_MAX_NUM_SEQS=32 FAKE_VLLM_TOKEN_DELAY=0.02 PY=$PWD/.venv/bin/python OUT=$OUT LOGS=$LOGS MODEL=/tmp/m PORT=12734 PV=12735 MAX_NUM_SEQS=32 HEAVY=200 HEAVY_TOKENS=64 LIGHT_TOKENS=8 DURATION=15 WARMUP=10 WEIGHTS_S=20 LATE_S=10 WEIGHT_STREAMS=40 MAX_RUNNING=16
ROUND=1 benchmarks/fairness.sh setup vllm round on diag stop summary
ROUND=2 benchmarks/fairness.sh vllm round stop summary
