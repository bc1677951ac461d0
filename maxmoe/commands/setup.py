"""Set-up shared by the verbs that run a config (train, bench): load, start devices, validate."""

from __future__ import annotations

from maxmoe.config_files import load_config
from maxmoe.distributed import initialize


def configure(items: list[str], reads_data: bool = False):
    """CONFIG files and KEY=VALUE overrides (any order) -> (Config, mesh sizes by axis name).

    Loads and validates the config, sets the fake CPU device count and joins jax.distributed,
    all before anything compiles, so a user mistake costs no compile time. Raises ConfigError.
    reads_data: the command reads cfg.data (train), so validation checks it suits the model.
    """
    files = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    cfg, origins = load_config(files, overrides)
    set_cpu_devices(cfg)
    import jax  # late: keeps `maxmoe --help` free of JAX (every command module imports this)

    initialize(cfg.distributed)
    # late: imports the model (JAX, Flax); loaded once the device count and jax.distributed are set
    from maxmoe.validation import validate

    sizes = validate(cfg, jax.device_count(), origins, jax.process_count(),
                     reads_data=reads_data)
    return cfg, sizes


def set_cpu_devices(cfg) -> None:
    """The config's mesh.cpu_devices fake CPU devices, set before JAX's backend starts."""
    import jax  # late: keeps `maxmoe --help` free of JAX (every command module imports this)

    if cfg.mesh.cpu_devices:
        try:
            jax.config.update("jax_num_cpu_devices", cfg.mesh.cpu_devices)
        except RuntimeError:  # backend already started (e.g. embedded use): keep its devices
            pass
