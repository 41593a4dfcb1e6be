#!/bin/bash
# two agents runs one after the other on one GPU: the four singles, then the two PD pairs; then the eager bench
SHA=$1
RES=/tmp/resB SKIP_EAGER=1 AGENT_BOUND=${BOUND_B:-660} bash devjob.sh $SHA hc_off,hc_bf16,hc_bf16_checksum,hc_fp8 3
RES=/tmp/resA SKIP_EAGER=1 AGENT_BOUND=${BOUND_A:-420} bash devjob.sh $SHA pd,pd_fixes_off 3
touch /tmp/CHAIN_DONE
