"""maxmoe: trains DeepSeek-V3-class Mixture-of-Experts models with JAX and Flax.

Layers, top first. A module imports only from its own package and the layers below it,
at the top of a file and inside functions alike; tests/test_imports.py reads this list and
fails on any import that goes up. Each line is a package (a folder) or a top-level module.
The order follows use: the model runs on parallel's dispatch and schedule and kernels, train
drives the model, and the verbs above train (convert, bench, plan) reach down into it; where
train must act for a verb above it, the verb passes it a hook.

    cli             the `maxmoe` entry point: parser, dispatch, exit codes
    commands        one module per verb: arguments and `run`, the work lives below
    report          the self-contained HTML page of run directories
    generate        text generation from a checkpoint: decode loop, sampling, decode mesh
    plan            memory, step time and cost of a config on a cluster (compiles the train step)
    bench           times the train step and reads its compiled memory (plan prices with it)
    convert         the `maxmoe convert` verbs: Hugging Face <-> maxmoe checkpoint directories
    train           state, step, optimizer, checkpoints, guards, the loop; hooks let verbs above
                    act on it (the planner's plan.json is one)
    metrics         FLOPs and MFU, writers, router health, host timing
    hf              Hugging Face files: safetensors, the tensor map, config.json, slice reads
    validation      a config checked against the devices before anything compiles
    section_checks  each config section's own fields checked (validation runs them first)
    data            tokenizers, sources, dedup and filters, the grain pipeline
    model           layers, attention, router, MoE, blocks, the transformer; config-derived facts
    parallel        expert dispatch, pipeline schedule and run, row groups
    kernels         grouped matmul, FP8, attention and LM-loss kernels
    sharding        logical axis names, the rules table, meshes
    cluster         device-kind and cluster files (configs/devices/, configs/cluster/): peaks,
                    memory, links, prices
    distributed     jax.distributed start-up
    malloc          which C allocator the process runs on (standard library only)
    config_files    YAML presets and dotted overrides -> Config, and back
    config          frozen dataclasses per concern, ConfigError
"""
