"""probe() and `mori backends`: usable or not, with the true reason; UCX loaded at run time only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mori_backend_ucx import UcxTransport
from mori_backend_ucx.transport import inventory

SYSTEM_UCP = Path("/lib/x86_64-linux-gnu/libucp.so.0")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (UCX is loaded once per process)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        check=False,
    )


def test_probe_names_what_ucx_found_here() -> None:
    inv = inventory("")
    a = UcxTransport().probe()
    assert a.usable, a.reason
    assert f"UCX {inv.ucx.version}" in a.reason
    # every transport UCX listed is in the reason, with its devices where it has some
    for tl, devs in inv.transports.items():
        assert tl in a.reason
        if devs != ["memory"]:
            assert f"{tl} ({', '.join(devs)})" in a.reason
    if not inv.rdma:
        assert "no RDMA" in a.reason and "tcp/shared memory/cma" in a.reason
    assert "loopback only" in a.reason  # nothing listens beyond loopback unless asked
    assert inv.transports.get("tcp") == ["lo"]
    assert "memory: host" in a.reason


def test_net_devices_option_widens_what_listens() -> None:
    r = _python(
        """
        from mori_backend_ucx import UcxTransport
        print(UcxTransport().probe().reason)
        """,
        MORI_UCX_OPTIONS="net_devices=all",
    )
    assert r.returncode == 0, r.stderr
    assert "loopback only" not in r.stdout
    assert "tcp (" in r.stdout and "lo" in r.stdout


def test_mori_backends_lists_ucx() -> None:
    mori = Path(sys.executable).with_name("mori")  # the console script of this environment
    r = subprocess.run([str(mori), "backends"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == ["ucx"])
    assert "mori-backend-ucx" in line and "available" in line and "UCX " in line


def test_without_usable_ucx_import_works_and_probe_says_why() -> None:
    r = _python(
        """
        import mori_backend_ucx.plugin
        from mori.core.errors import MoriBackendError
        from mori_backend_ucx import UcxTransport
        a = UcxTransport().probe()
        print("usable", a.usable)
        print("reason", a.reason)
        try:
            UcxTransport().ops()
        except MoriBackendError as e:
            print("ops", e)
        """,
        MORI_UCX_LIBRARY="/nonexistent/libucp.so.0",
    )
    assert r.returncode == 0, r.stderr
    assert "usable False" in r.stdout
    assert "/nonexistent/libucp.so.0" in r.stdout and "does not exist" in r.stdout
    assert "ops MORI_UCX_LIBRARY" in r.stdout


def test_without_the_wheel_probe_says_how_to_get_it() -> None:
    r = _python(
        """
        import sys
        sys.modules["libucx"] = None  # as if libucx-cu12 were not installed
        from mori_backend_ucx import UcxTransport
        a = UcxTransport().probe()
        print(a.usable, a.reason)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False") and "pip install libucx-cu12" in r.stdout


def test_bad_options_in_the_environment_make_probe_unusable() -> None:
    r = _python(
        """
        from mori_backend_ucx import UcxTransport
        a = UcxTransport().probe()
        print(a.usable, a.reason)
        """,
        MORI_UCX_OPTIONS="tls=tcp;colour=blue",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False") and "unknown option 'colour'" in r.stdout


@pytest.mark.skipif(not SYSTEM_UCP.exists(), reason=f"no system UCX here ({SYSTEM_UCP} does not exist)")
def test_system_ucx_is_loaded_on_request() -> None:
    r = _python(
        """
        from mori_backend_ucx import UcxTransport
        from mori_backend_ucx.library import load
        a = UcxTransport().probe()
        print(load().libucp)
        print(a.usable, a.reason)
        """,
        MORI_UCX_LIBRARY="system",
    )
    assert r.returncode == 0, r.stderr
    libucp, reason = r.stdout.splitlines()[:2]
    assert "libucx" not in libucp and "(system)" in reason
    # a system UCX built with verbs: the reason blames the missing device, not the build
    if (
        Path(libucp).parent.joinpath("ucx", "libuct_ib.so.0").exists()
        and not Path("/sys/class/infiniband").is_dir()
    ):
        assert "no RDMA device on this machine" in reason


def test_a_small_dev_shm_leaves_posix_out_instead_of_crashing() -> None:
    # UCX 1.22's posix transport segfaults in ucp_init with a 16 MiB /dev/shm (a container's):
    # played in a mount namespace of its own, where such a tmpfs is mounted over /dev/shm.
    import shutil

    cmd = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"', "sh"]
    if shutil.which("unshare") is None or subprocess.run([*cmd, "true"], capture_output=True).returncode:
        pytest.skip("unshare --mount / mount tmpfs is not permitted here")
    code = "from mori_backend_ucx import UcxTransport as T; t = T(); print(t.options()); print(t.probe())"
    env = {k: v for k, v in os.environ.items() if k not in ("UCX_TLS", "MORI_UCX_OPTIONS")}
    out = subprocess.run(
        [*cmd, sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    options, availability = out.stdout.splitlines()[:2]
    assert (
        options == "tls=^posix"
        and "usable=True" in availability
        and "posix" not in availability.split("(", 2)[2]
    )
