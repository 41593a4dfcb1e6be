#!/bin/bash
# device job: the kernels' GPU tests, the eager indexer bench (5 sweeps), then the agents set's targets
SHA=$1; TARGETS=${2:-pd,pd_fixes_off}; ROUNDS=${3:-3}
RES=${RES:-/tmp/res}
rm -rf /tmp/ck $RES && mkdir -p /tmp/ck $RES && cp -r bench harness src tests pyproject.toml /tmp/ck/ && cd /tmp/ck
. /tmp/dsv4-bundle/root/env.sh
export PYTHONPATH=/tmp/ck/src:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > $RES/smi.txt 2>&1
timeout 300 python3 -m pytest -m gpu tests/kernels/test_gpu.py -q -p no:cacheprovider --junitxml=$RES/gpu_tests.xml > $RES/gpu_tests.out 2>&1
echo "gpu tests rc=$?" >> $RES/gpu_tests.out
touch $RES/TESTS_DONE
if [ -z "$SKIP_EAGER" ]; then
  COMMIT=$SHA OUT_JSON=$RES/eager_pin.json timeout 400 python3 -m bench.indexer --eager-only --eager-repeats 5 > $RES/eager_pin.out 2>&1
fi
touch $RES/EAGER_DONE
DSV4_GPU_AGENT_ROUNDS=$ROUNDS DSV4_GPU_AGENT_LEVEL_S=120 DSV4_GPU_AGENT_TARGETS=$TARGETS \
  timeout -s TERM ${AGENT_BOUND:-1080} python3 -m bench.gpu_server run agents --mem-fraction 0.85 --commit $SHA \
  --out $RES/agents.json > $RES/agents.out 2>&1
echo "agents rc=$?" >> $RES/agents.out
(cd $RES && tar cJf levels.tar.xz logs_agents/work 2>/dev/null)
python3 -m bench.airgap cache save --out $RES/jit >> $RES/agents.out 2>&1
touch $RES/DONE
