#!/bin/bash
# device job: the agents set (all targets by default) into $RES, its levels and profiles tarred, the eager
# indexer bench on the bundle's stack (unless SKIP_EAGER), then the JIT cache
SHA=$1; TARGETS=${2:-hc_off,hc_bf16,hc_bf16_checksum,hc_fp8,hc_bf16_again,pd,pd_fixes_off}; ROUNDS=${3:-3}
RES=${RES:-/tmp/res}
rm -rf /tmp/ck $RES && mkdir -p /tmp/ck $RES && cp -r bench harness src tests pyproject.toml /tmp/ck/ && cd /tmp/ck
. /tmp/dsv4-bundle/root/env.sh
export PYTHONPATH=/tmp/ck/src:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > $RES/smi.txt 2>&1
DSV4_GPU_AGENT_ROUNDS=$ROUNDS DSV4_GPU_AGENT_LEVEL_S=120 DSV4_GPU_AGENT_TARGETS=$TARGETS \
  timeout -s TERM ${AGENT_BOUND:-1080} python3 -m bench.gpu_server run agents --mem-fraction 0.85 --commit $SHA \
  --out $RES/agents.json > $RES/agents.out 2>&1
echo "agents rc=$?" >> $RES/agents.out
(cd $RES && tar cJf levels.tar.xz logs_agents/work 2>/dev/null)
touch $RES/AGENTS_DONE
if [ -z "$SKIP_EAGER" ]; then
  COMMIT=$SHA OUT_JSON=$RES/eager_pin.json timeout 400 python3 -m bench.indexer --eager-only --eager-repeats 5 > $RES/eager_pin.out 2>&1
fi
python3 -m bench.airgap cache save --out $RES/jit >> $RES/agents.out 2>&1
touch $RES/DONE
