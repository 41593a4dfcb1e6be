#!/bin/bash
# device job: the agents set once per target group (args after the sha, e.g. pd,pd_fixes_off hc_bf16,hc_bf16_checksum),
# each into $RES/<group>, its levels tarred; then the JIT cache
SHA=$1; shift; ROUNDS=${ROUNDS:-3}; RES=${RES:-/tmp/res}
rm -rf /tmp/ck $RES && mkdir -p /tmp/ck $RES && cp -r bench harness src tests pyproject.toml /tmp/ck/ && cd /tmp/ck
. /tmp/dsv4-bundle/root/env.sh
export PYTHONPATH=/tmp/ck/src:$PYTHONPATH PYTHONUNBUFFERED=1 COMMIT=$SHA
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > $RES/smi.txt 2>&1
python3 -m bench.hook_time_cpu --out $RES/hook_time_cpu.json > $RES/hook_time_cpu.out 2>&1
for group in "$@"; do
  tag=${group//,/_}; mkdir -p $RES/$tag
  date -u +%FT%TZ > $RES/$tag/started
  if [ "$group" = hicache_cost ]; then
    DSV4_GPU_STORM_SECONDS=20 DSV4_GPU_COST_ROUNDS=5 timeout -s TERM 500 python3 -m bench.gpu_server run hicache \
      --only hc_kernel_layer_first_checksum,hc_kernel_layer_first --commit $SHA \
      --out $RES/$tag/hicache.json > $RES/$tag/agents.out 2>&1
    echo "hicache rc=$?" >> $RES/$tag/agents.out
    (cd $RES/$tag && tar cJf levels.tar.xz logs_hicache 2>/dev/null)
  else
  DSV4_GPU_AGENT_ROUNDS=$ROUNDS DSV4_GPU_AGENT_STARTS=${STARTS:-2} DSV4_GPU_AGENT_LEVEL_S=120 DSV4_GPU_AGENT_TARGETS=$group \
    timeout -s TERM ${AGENT_BOUND:-660} python3 -m bench.gpu_server run agents --mem-fraction 0.85 --commit $SHA \
    --out $RES/$tag/agents.json > $RES/$tag/agents.out 2>&1
  echo "agents rc=$?" >> $RES/$tag/agents.out
  (cd $RES/$tag && tar cJf levels.tar.xz logs_agents/work 2>/dev/null)
  fi
  touch $RES/$tag/DONE
done
[ "${NOSAVE:-0}" = 1 ] || python3 -m bench.airgap cache save --out $RES/jit > $RES/cache_save.out 2>&1
touch $RES/DONE
