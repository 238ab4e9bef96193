"""`python -m infer.engine.node [engine flags]`: a host other than node 0 of a multi-host
tensor-parallel engine runs its ranks here (infer.engine.tensor_parallel_worker.run_node), with the
flags node 0 was given and its own --node-rank."""

import sys

from infer.engine.tensor_parallel_worker import node_main

if __name__ == "__main__":
    sys.exit(node_main())
