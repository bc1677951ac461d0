"""One module per `maxmoe` verb: `add_parser(subparsers)` registers the verb's arguments and
sets `run(args) -> exit code`; maxmoe/cli.py builds the parser from them and dispatches.

A command module holds argument parsing and `run` only; the work it starts lives in the library
(maxmoe/bench.py, maxmoe/convert/, maxmoe/data/, maxmoe/train/). Imports of library code that
pulls in JAX (or another heavy package) sit inside `run`, so that `maxmoe --help` builds every
parser without importing JAX. Set-up that several verbs share (config, devices,
jax.distributed, validation) is in `setup.py`.
"""
