#!/bin/bash
# device job: the abort_safety set (top-k lane) into $RES/abort, then the fix's price (agents pd,pd_fixes_off ALONE), then the JIT cache
SHA=$1; RES=${RES:-/tmp/res}
rm -rf /tmp/ck $RES && mkdir -p /tmp/ck $RES/abort $RES/price && cp -r bench harness src tests tools pyproject.toml /tmp/ck/ && cd /tmp/ck
. /tmp/dsv4-bundle/root/env.sh
export PYTHONPATH=/tmp/ck/src:$PYTHONPATH PYTHONUNBUFFERED=1 COMMIT=$SHA
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > $RES/smi.txt 2>&1
date -u +%FT%TZ > $RES/abort/started
DSV4_GPU_ABORT_LANE_ROUNDS=${ROUNDS:-5} DSV4_GPU_ABORT_LANE_ONLY=${LANE_ONLY:-0} DSV4_GPU_ABORT_TARGETS=${TARGETS:-} timeout -s TERM ${BOUND:-1500} python3 -m bench.gpu_server run abort_safety --commit $SHA --startup-timeout ${STARTUP:-900} \
  --mem-fraction ${MEMF:-0.7} --out $RES/abort/abort_safety.json > $RES/abort/run.out 2>&1
echo "run rc=$?" >> $RES/abort/run.out
touch $RES/abort/DONE
[ "${NOSAVE:-0}" = 1 ] || python3 -m tools.airgap cache save --out $RES/jit > $RES/cache_save.out 2>&1
if [ "${PRICE:-1}" = 1 ]; then
date -u +%FT%TZ > $RES/price/started
DSV4_GPU_AGENT_ALONE=1 DSV4_GPU_AGENT_ROUNDS=1 DSV4_GPU_AGENT_STARTS=4 DSV4_GPU_AGENT_LEVEL_S=120 DSV4_GPU_AGENT_TARGETS=pd,pd_fixes_off \
  timeout -s TERM ${AGENT_BOUND:-700} python3 -m bench.gpu_server run agents --mem-fraction 0.85 --commit $SHA \
  --out $RES/price/agents.json > $RES/price/agents.out 2>&1
echo "agents rc=$?" >> $RES/price/agents.out
(cd $RES/price && tar cJf levels.tar.xz logs_agents/work 2>/dev/null)
touch $RES/price/DONE
fi
touch $RES/DONE
