"""The command line starting processes (no torch job): ``ddpscope run``'s children and
their exit codes, the start-up hook, stop signals.

(Arguments, a child's environment and dump in-process: tests/unit/test_cli.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddpscope.cli import launch
from ddpscope.cli import run as run_cmd
from tests.support.torchrun import ROOT, job_env
from tests.unit.test_cli import _recording

DDPSCOPE = [sys.executable, "-m", "ddpscope"]


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        [*DDPSCOPE, *args],
        env=env or job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


# --- exit codes ------------------------------------------------------------


def test_run_returns_the_child_exit_code(tmp_path: Path) -> None:
    proc = _cli("run", "--record", str(tmp_path), "--", sys.executable, "-c", "raise SystemExit(7)")
    assert proc.returncode == 7


def test_run_says_where_the_recording_goes_and_that_a_job_with_no_model_recorded_nothing(
    tmp_path: Path,
) -> None:
    proc = _cli(
        "run", "--record", str(tmp_path), "--run-id", "my-run", "--", sys.executable, "-c", "pass"
    )
    assert proc.returncode == 0
    lines = proc.stderr.splitlines()
    assert len(lines) == 2
    assert str(tmp_path / "my-run") in lines[0]
    # An FSDP job, or one that ended before its model: silence would read as "healthy".
    assert lines[1].startswith("ddpscope: run my-run recorded nothing: no process of the job")


def test_a_job_whose_ddp_constructor_raised_is_told_why_nothing_was_recorded(
    tmp_path: Path,
) -> None:
    # A world of one, and a model with nothing to train: DDP's constructor raises.
    code = textwrap.dedent(
        f"""
        import torch.distributed as dist
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
        DDP(nn.ReLU())
        """
    )
    proc = _cli("run", "--record", str(tmp_path), "--run-id", "r", "--", sys.executable, "-c", code)
    assert proc.returncode == 1
    assert "RuntimeError" in proc.stderr  # the job's own traceback, untouched
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("ddpscope: run r recorded nothing: no process of the job attached")
    assert "DistributedDataParallel(...) raised on a process at <string>:6: RuntimeError: " in last


def test_run_of_a_missing_program_is_127(tmp_path: Path) -> None:
    proc = _cli("run", "--record", str(tmp_path), "--", "no-such-program-ddpscope")
    assert proc.returncode == 127
    assert "no-such-program-ddpscope" in proc.stderr


def test_cli_never_imports_torch(tmp_path: Path) -> None:
    _recording(tmp_path)
    code = textwrap.dedent(
        f"""
        import sys
        from ddpscope.cli.main import main
        assert main(["dump", {str(tmp_path)!r}]) == 0
        assert main(["run", "--record", {str(tmp_path)!r}, "--", sys.executable, "-c", ""]) == 0
        assert main(["run", "--help"]) == 0
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# --- the start-up hook -------------------------------------------------------

PROBE = textwrap.dedent(
    """
    import json, sys
    print("hello from the child", flush=True)
    print(json.dumps({
        "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
        "ddpscope": sorted(m for m in sys.modules if m.split(".")[0] == "ddpscope"),
        "watching": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_DDPWatch"],
        "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
    }))
    """
)


def test_bootstrap_leaves_a_process_without_ddp_alone(tmp_path: Path, endpoint: str) -> None:
    proc = _cli(
        "run", "--record", str(tmp_path), "--endpoint", endpoint, "--", sys.executable, "-c", PROBE
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == "hello from the child"
    seen = json.loads(out[1])
    assert seen["torch"] == [] and seen["ddpscope"] == []
    assert seen["watching"] == ["_DDPWatch"]  # the hook ran, and only waits
    assert "warning" not in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing built DDP, so nothing was recorded


def test_bootstrap_does_nothing_without_autoattach(tmp_path: Path) -> None:
    env = job_env(PYTHONPATH=os.pathsep.join([run_cmd.BOOTSTRAP_DIR, str(ROOT)]))
    env.pop("DDPSCOPE_AUTOATTACH", None)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[1])["watching"] == []


def test_shadowed_sitecustomize_still_runs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.environ.get('DDPSCOPE_AUTOATTACH'):  # in the child, not the launcher\n"
        "    print('user sitecustomize ran', file=sys.stderr)\n"
        "os.environ['USER_SITE_RAN'] = '1'\n"
        "MARK = 'theirs'\n"
    )
    env = job_env(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    code = "import os, sitecustomize; print(os.environ.get('USER_SITE_RAN'), sitecustomize.MARK)"
    proc = _cli("run", "--record", str(tmp_path / "rec"), "--", sys.executable, "-c", code, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1 theirs"
    assert proc.stderr.count("user sitecustomize ran") == 1


def test_failing_shadowed_sitecustomize_gives_one_warning(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("raise RuntimeError('broken site')\n")
    env = job_env(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    proc = _cli(
        "run",
        "--record",
        str(tmp_path / "rec"),
        "--",
        sys.executable,
        "-c",
        "print('still runs')",
        env=env,
    )
    assert proc.returncode == 0
    assert proc.stdout.strip() == "still runs"
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "broken site" in warnings[0]


# --- signals -----------------------------------------------------------------

SLEEPER = textwrap.dedent(
    """
    import os, signal, sys, time
    if sys.argv[1] == "exit5":
        signal.signal(signal.SIGTERM, lambda *a: os._exit(5))
    print(os.getpid(), flush=True)
    time.sleep(60)
    """
)


def _start_sleeper(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    launcher = subprocess.Popen(
        [*DDPSCOPE, "run", "--record", str(tmp_path), "--", sys.executable, "-c", SLEEPER, mode],
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert launcher.stdout is not None
    child_pid = int(launcher.stdout.readline())
    return launcher, child_pid


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(
    ("sig", "mode", "expected"),
    [
        (signal.SIGTERM, "default", 128 + signal.SIGTERM),
        (signal.SIGINT, "default", 128 + signal.SIGINT),
        (signal.SIGTERM, "exit5", 5),
    ],
)
def test_stop_signal_reaches_the_child_and_its_status_comes_back(
    tmp_path: Path, sig: signal.Signals, mode: str, expected: int
) -> None:
    launcher, child_pid = _start_sleeper(tmp_path, mode)
    try:
        launcher.send_signal(sig)
        assert launcher.wait(timeout=10) == expected
        assert _gone(child_pid)
    finally:
        launcher.kill()
        launcher.communicate()


def test_a_stop_signal_that_comes_while_the_job_starts_reaches_it_once_started(
    tmp_path: Path,
) -> None:
    # The handlers are in place before the child exists: a signal in between
    # waits in the forwarder and goes to the job's group as soon as it has one.
    forwarder = launch.Forwarder()
    forwarder.handle(signal.SIGTERM)
    child = launch.start_job(
        [sys.executable, "-c", SLEEPER, "default"], job_env(), forwarder, stdout=subprocess.PIPE
    )
    assert not isinstance(child, int)
    try:
        assert launch.exit_status(child.wait(timeout=30)) == 128 + signal.SIGTERM
        assert forwarder.pgid == child.pid and forwarder.pending == []
    finally:
        child.process.kill()
        child.process.communicate()


def test_launch_reports_a_killed_job_as_a_shell_does() -> None:
    command = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    assert launch.launch(command, job_env()) == 128 + signal.SIGKILL
    assert launch.launch([sys.executable, "-c", "raise SystemExit(7)"], job_env()) == 7
