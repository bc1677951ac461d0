"""maxmoe.malloc: which allocator `maxmoe` restarts itself with, and that it restarts once."""

import os
import subprocess
import sys

import pytest

from maxmoe import malloc

MADVISE, ALWAYS = "always [madvise] never", "[always] madvise never"


@pytest.fixture
def host(monkeypatch, tmp_path):
    """A fake machine: library dirs (empty until `install`) and a THP mode file."""
    libs = tmp_path / "lib"
    libs.mkdir()
    monkeypatch.setattr(malloc, "library_dirs", lambda: [str(tmp_path / "none"), str(libs)])
    monkeypatch.setattr(malloc, "THP_MODE", str(tmp_path / "thp"))
    monkeypatch.setattr(malloc.sys, "platform", "linux")
    dev = tmp_path / "dev"
    dev.mkdir()
    monkeypatch.setattr(malloc, "ACCELERATOR_NODES", (str(dev / "nvidia[0-9]*"), str(dev / "kfd")))

    class Host:
        def install(self, *names):
            for name in names:
                (libs / malloc.PRELOADS[name][0][0]).write_text("")

        def thp(self, mode):
            (tmp_path / "thp").write_text(mode + "\n")

        def lib(self, name):
            return str(libs / malloc.PRELOADS[name][0][0])

        def gpu(self, node="nvidia3"):  # a container may see only its own GPU's node
            (dev / node).write_text("")
    h = Host()
    h.thp(MADVISE)
    return h


@pytest.mark.parametrize("installed, env, thp, expect", [
    (("jemalloc", "tcmalloc"), {}, MADVISE, "tcmalloc"),  # first choice
    (("jemalloc",), {}, MADVISE, "jemalloc"),
    ((), {}, MADVISE, "glibc"),  # no preload: glibc asks for huge pages
    ((), {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, MADVISE, "glibc"),
    ((), {}, ALWAYS, None),  # the kernel gives huge pages already
    (("jemalloc", "tcmalloc"), {"MAXMOE_MALLOC": "jemalloc"}, MADVISE, "jemalloc"),
    (("jemalloc",), {"MAXMOE_MALLOC": "glibc"}, MADVISE, "glibc"),
    (("jemalloc",), {"MAXMOE_MALLOC": "off"}, MADVISE, None),
    (("jemalloc",), {"LD_PRELOAD": "/opt/libtcmalloc.so"}, MADVISE, None),  # the user's choice
    (("jemalloc",), {"LD_PRELOAD": "/opt/libtrace.so", "MALLOC_CONF": "narenas:2"}, MADVISE,
     "jemalloc"),
])
def test_restart_env_picks_one_allocator_once(host, installed, env, thp, expect):
    host.install(*installed)
    host.thp(thp)
    new = malloc.restart_env(env)
    if expect is None:
        assert new is None
        return
    extended = ("LD_PRELOAD", "GLIBC_TUNABLES")
    assert all(new[k] == v for k, v in env.items() if k not in extended)  # the user's own kept
    if expect == "glibc":
        before = env.get("GLIBC_TUNABLES")
        assert new["GLIBC_TUNABLES"] == (f"{before}:" if before else "") + malloc.HUGE_PAGES_TUNABLE
        assert "LD_PRELOAD" not in new
    else:
        preload = new["LD_PRELOAD"].split(":")
        assert preload[-1] == host.lib(expect)  # after the user's own preloads
        assert preload[:-1] == ([env["LD_PRELOAD"]] if "LD_PRELOAD" in env else [])
        for key, value in malloc.PRELOADS[expect][2].items():
            assert new[key] == env.get(key, value)
    assert malloc.restart_env(new) is None  # the restarted process runs on: no exec loop


@pytest.mark.parametrize("node, env, expect", [
    (None, {}, "tcmalloc"),  # no accelerator node: XLA:CPU, where it was measured
    ("nvidia3", {}, None),  # an NVIDIA GPU: auto leaves the process alone
    ("kfd", {}, None),  # AMD ROCm
    ("nvidia0", {"JAX_PLATFORMS": "cpu"}, "tcmalloc"),  # a GPU host running JAX on CPU
    (None, {"JAX_PLATFORMS": "cuda,cpu"}, None),
    ("nvidia0", {"MAXMOE_MALLOC": "tcmalloc"}, "tcmalloc"),  # an explicit choice still applies
    ("nvidia0", {"MAXMOE_MALLOC": "glibc"}, "glibc"),
])
def test_auto_restarts_only_where_jax_runs_on_cpu(host, node, env, expect):
    host.install("tcmalloc")
    if node:
        host.gpu(node)
    new = malloc.restart_env(env)
    if expect is None:
        assert new is None
    elif expect == "glibc":
        assert "LD_PRELOAD" not in new and malloc.HUGE_PAGES_TUNABLE in new["GLIBC_TUNABLES"]
    else:
        assert new["LD_PRELOAD"] == host.lib(expect)


@pytest.mark.parametrize("value, words", [
    ("jemaloc", ["MAXMOE_MALLOC='jemaloc'", "auto, tcmalloc, jemalloc, glibc, off"]),
    ("jemalloc", ["libjemalloc.so.2", "apt install libjemalloc2", "unset MAXMOE_MALLOC"]),
])
def test_bad_choice_is_a_one_line_error(host, monkeypatch, capsys, value, words):
    with pytest.raises(malloc.MallocError) as e:
        malloc.restart_env({"MAXMOE_MALLOC": value})
    assert all(w in str(e.value) for w in words)
    monkeypatch.setenv("MAXMOE_MALLOC", value)
    monkeypatch.setattr(malloc.os, "execve", lambda *a: pytest.fail("restarted"))
    with pytest.raises(SystemExit) as stop:
        malloc.reexec(["-m", "maxmoe.cli"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("maxmoe: error: ") and err.count("\n") == 1 and words[0] in err


def test_reexec_restarts_this_python_with_the_new_env(host, monkeypatch):
    host.install("jemalloc")
    monkeypatch.delenv("MAXMOE_MALLOC", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    seen = {}

    def fake_execve(path, args, env):
        seen.update(path=path, args=args, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(malloc.os, "execve", fake_execve)
    with pytest.raises(SystemExit):
        malloc.reexec(["-m", "maxmoe.cli", "bench", "configs/tiny.yaml"])
    assert seen["path"] == sys.executable
    assert seen["args"] == [sys.executable, "-m", "maxmoe.cli", "bench", "configs/tiny.yaml"]
    assert seen["env"]["LD_PRELOAD"] == host.lib("jemalloc")


REAL = {name: malloc.find(name) for name in malloc.PRELOADS}


@pytest.mark.parametrize("name", sorted(REAL))
def test_in_use_sees_a_real_preload(name):
    """A process started with the allocator preloaded reports it (skipped where not installed);
    this test process itself runs on glibc's malloc."""
    assert malloc.in_use().startswith("glibc")
    if REAL[name] is None:
        pytest.skip(f"{name} is not installed here")
    env = {**os.environ, "LD_PRELOAD": REAL[name]}
    code = "from maxmoe import malloc; print(malloc.in_use())"
    out = subprocess.run([sys.executable, "-c", code],
                         env=env, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == name
