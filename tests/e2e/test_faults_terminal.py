"""`run`, `watch` and `replay` on a real terminal that goes away, or gets a stop
signal, in every state: starting, job running, job done, on a modal screen.

The terminal is a pseudo-terminal; closing its master side is what killing a
tmux session or losing an ssh connection does (the kernel hangs the terminal
up and sends SIGHUP). Each test checks that the command is gone within a
bound, its port is free, the job's processes are gone, and the recording
reads back whole.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.faults import (
    DDPSCOPE,
    GONE_S,
    LONG_JOB,
    STOP,
    TORCHRUN_SIGNALLED,
    all_gone,
    ddpscope_temp_files,
    descendants,
    ends,
    free_tcp_endpoint,
    kill_all,
    leftovers,
    port_free,
    private_tmp,
    ranks_training,
    read_back,
    torchrun_demo,
    until,
)
from tests.support.terminal import Terminal
from tests.support.torchrun import job_env, teardown_abort_only

SIZE = (160, 50)
#: A line of the help screen, live and in replay (replay gives space its own line).
HELP_TEXT = "this help / close it"


def _env(**extra: str) -> dict[str, str]:
    return job_env(TERM="xterm-256color", **extra)


def _run_argv(record: Path, endpoint: str, *job: str) -> list[str]:
    return [*DDPSCOPE, "run", "--record", str(record), "--run-id", "t", "--endpoint", endpoint,
            "--", *job]  # fmt: skip


def _ui_up(term: Terminal) -> None:
    term.wait_for("listening on", timeout=60)


# --- ddpscope run, with a real torchrun job ------------------------------------------


@pytest.fixture
def job_run(tmp_path: Path) -> Iterator[tuple[Path, str, list[Terminal]]]:
    """A record dir, a free port; every terminal started is closed and its job's
    processes killed at the end, whatever the test did."""
    terms: list[Terminal] = []
    yield tmp_path / "rec", free_tcp_endpoint(), terms
    for term in terms:
        procs = descendants(term.pid) if term.poll() is None else []
        term.close()
        kill_all(procs)


def _start_run(
    job_run: tuple[Path, str, list[Terminal]], *job_args: str, argv: list[str] | None = None
) -> tuple[Terminal, Path, str]:
    record, endpoint, terms = job_run
    tmp = private_tmp(record.parent)
    argv = argv or _run_argv(record, endpoint, *torchrun_demo(*job_args))
    term = Terminal(argv, _env(TMPDIR=str(tmp)), SIZE)
    terms.append(term)
    return term, record, endpoint


def _assert_cleaned_up(term: Terminal, procs: list, record: Path, endpoint: str) -> None:
    all_gone(procs)  # torchrun and both workers
    assert port_free(endpoint)
    assert leftovers(record / "t") == []
    assert ddpscope_temp_files(private_tmp(record.parent)) == []


@pytest.mark.torchrun
def test_run_whose_terminal_is_lost_mid_run_stops_the_job_and_exits(job_run) -> None:
    term, record, endpoint = _start_run(job_run, *LONG_JOB)
    _ui_up(term)
    until(lambda: ranks_training(record / "t"), 120, "both ranks training")
    procs = descendants(term.pid)
    assert len(procs) >= 3  # torchrun's agent and two workers
    term.hang_up()
    # The job got the SIGHUP a job run in that terminal would have got; the
    # launcher returns torchrun's status once torchrun has stopped its workers.
    assert term.exit_status(timeout=GONE_S) == TORCHRUN_SIGNALLED
    _assert_cleaned_up(term, procs, record, endpoint)
    rec = read_back(record)
    assert ends(rec) == {0: [("signal", "SIGHUP")], 1: [("signal", "SIGHUP")]}


@pytest.mark.torchrun
@pytest.mark.parametrize("modal", [False, True], ids=["main-screen", "help-screen"])
def test_run_whose_terminal_is_lost_after_the_job_ended_exits_with_its_status(
    job_run, modal: bool
) -> None:
    term, record, endpoint = _start_run(job_run, "--epochs", "1")
    _ui_up(term)
    term.wait_for("job exited", timeout=120)
    procs = descendants(term.pid)
    if modal:
        term.send("?")
        term.wait_for(HELP_TEXT)
    term.hang_up()
    status = term.exit_status(timeout=GONE_S)
    log = (record / "t" / "job.log").read_text()
    assert "done:" in log
    # 0, or torch's own gloo teardown abort after training (see conftest).
    assert status == 0 or (status == 1 and "terminate called" in log), log[-2000:]
    _assert_cleaned_up(term, procs, record, endpoint)
    assert {r: e[-1][0] for r, e in ends(read_back(record)).items()} == {0: "exit", 1: "exit"}


@pytest.mark.torchrun
@pytest.mark.parametrize("sig", STOP, ids=lambda s: s.name)
def test_a_stop_signal_to_run_mid_run_reaches_the_workers_and_run_returns_torchruns_status(
    job_run, sig: signal.Signals
) -> None:
    term, record, endpoint = _start_run(job_run, *LONG_JOB)
    _ui_up(term)
    until(lambda: ranks_training(record / "t"), 120, "both ranks training")
    procs = descendants(term.pid)
    os.kill(term.pid, sig)
    assert term.exit_status(timeout=GONE_S) == TORCHRUN_SIGNALLED
    _assert_cleaned_up(term, procs, record, endpoint)
    # Every worker got the signal and said so in its record before it ended.
    expected = ("exception", "KeyboardInterrupt") if sig == signal.SIGINT else ("signal", sig.name)
    for rank, found in ends(read_back(record)).items():
        assert len(found) == 1 and found[0][0] == expected[0], (rank, found)
        assert found[0][1].startswith(expected[1]) or expected[1] in found[0][1], (rank, found)


@pytest.mark.torchrun
def test_a_stop_signal_while_run_starts_stops_the_job_before_the_ui_is_up(job_run) -> None:
    term, record, endpoint = _start_run(job_run, *LONG_JOB)
    term.wait_for("ddpscope: recording run")  # the launcher is up; the UI and job are not yet
    os.kill(term.pid, signal.SIGTERM)
    status = term.exit_status(timeout=GONE_S)
    # Before the launcher installed its handlers the default action ended it
    # (-15); after, the job got the signal and torchrun's status came back.
    assert status in (-signal.SIGTERM, TORCHRUN_SIGNALLED, 128 + signal.SIGTERM)
    until(lambda: port_free(endpoint), 10, "port free")
    until(lambda: not _demo_processes(record), 30, "no worker of this job left")


def _demo_processes(record: Path) -> list[str]:
    # Workers are found by their command line: ours carry this test's record dir
    # only in their environment, so match the launcher's unique run dir instead.
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            env = p.info.get("environ") or {}
        except psutil.Error:
            continue
        if env.get("DDPSCOPE_RECORD") == str(record):
            found.append(" ".join(p.info.get("cmdline") or []))
    return found


@pytest.mark.torchrun
def test_run_with_sighup_ignored_keeps_the_job_past_a_lost_terminal(job_run) -> None:
    record, endpoint, _ = job_run
    # As after `trap '' HUP` (what nohup does): the terminal can go, the job stays.
    ignore_hup = (
        "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    job = torchrun_demo("--epochs", "6", "--step-sleep-ms", "20")
    argv = [sys.executable, "-c", ignore_hup, *_run_argv(record, endpoint, *job)[1:]]
    term, record, endpoint = _start_run(job_run, argv=argv)
    _ui_up(term)
    until(lambda: ranks_training(record / "t"), 120, "both ranks training")
    procs = descendants(term.pid)
    term.hang_up()
    # The UI notices its terminal is gone and ends; the launcher waits for the job.
    status = term.exit_status(timeout=180)
    log = (record / "t" / "job.log").read_text()
    assert "done: 96 steps on 2 ranks" in log, log[-2000:]
    assert status == 0 or (status == 1 and "terminate called" in log), log[-2000:]
    _assert_cleaned_up(term, procs, record, endpoint)
    read_back(record)


# --- ddpscope watch ------------------------------------------------------------------


@pytest.fixture
def watch_term(tmp_path: Path) -> Iterator[tuple[Terminal, str]]:
    endpoint = free_tcp_endpoint()
    term = Terminal([*DDPSCOPE, "watch", "--endpoint", endpoint], _env(), SIZE)
    yield term, endpoint
    term.close()


def _into(term: Terminal, state: str) -> None:
    if state == "help-screen":
        term.send("?")
        term.wait_for(HELP_TEXT)
    elif state == "paused":
        term.send(" ")
        term.wait_for("PAUSED")
    elif state == "rank-detail":
        term.send("\r")  # the first rank's detail
        term.wait_for("local rank")
    elif state == "go-to-prompt":
        term.send("g")
        term.wait_for("Go to step")


@pytest.mark.parametrize("state", ["main-screen", "help-screen", "paused"])
def test_watch_whose_terminal_is_lost_exits_and_frees_its_port(watch_term, state: str) -> None:
    term, endpoint = watch_term
    _ui_up(term)
    _into(term, state)
    term.hang_up()
    assert term.exit_status(timeout=GONE_S) == 128 + signal.SIGHUP
    assert port_free(endpoint)


@pytest.mark.parametrize("sig", STOP, ids=lambda s: s.name)
@pytest.mark.parametrize("state", ["main-screen", "help-screen"])
def test_a_stop_signal_ends_watch_in_any_state(watch_term, sig: signal.Signals, state: str) -> None:
    term, endpoint = watch_term
    _ui_up(term)
    _into(term, state)
    os.kill(term.pid, sig)
    assert term.exit_status(timeout=GONE_S) == 128 + sig
    assert port_free(endpoint)


def test_a_sigcont_to_a_running_watch_starts_nothing_and_q_still_quits(watch_term) -> None:
    # The kernel sends SIGCONT with a lost terminal's SIGHUP; `kill -CONT` and
    # a shell's bg/fg send it alone. Textual restarted its terminal threads on
    # each, and the extra input threads kept the process alive after q.
    import psutil

    term, endpoint = watch_term
    _ui_up(term)
    _into(term, "paused")  # idle: the signal lands while the event loop waits
    threads = psutil.Process(term.pid).num_threads()
    for _ in range(3):
        os.kill(term.pid, signal.SIGCONT)
        term.read_for(0.3)
    assert psutil.Process(term.pid).num_threads() == threads
    term.send("q")
    assert term.exit_status(timeout=GONE_S) == 0
    assert port_free(endpoint)


def _drained(term: Terminal) -> bool:
    term.read_for(0.05)
    return True


def test_a_suspended_watch_resumes_drawing_on_sigcont_each_time(watch_term) -> None:
    # Three rounds: Textual repainted only what had changed on a resume, and
    # from the second one on the screen came back blank but for a panel.
    import psutil

    term, _ = watch_term
    _ui_up(term)
    proc = psutil.Process(term.pid)
    for n in range(3):
        os.kill(term.pid, signal.SIGTSTP)
        # Drained meanwhile: the app writes its last frame before it stops itself.
        until(
            lambda: _drained(term) and proc.status() == psutil.STATUS_STOPPED,
            10,
            lambda n=n: f"stopped, round {n}: {proc.status()}; drawn last: {term.text[-600:]!r}",
        )
        term.raw = b""
        os.kill(term.pid, signal.SIGCONT)
        term.wait_for("listening on")  # the whole screen drawn again
    term.send("q")
    assert term.exit_status(timeout=GONE_S) == 0


def test_a_stop_signal_while_watch_starts_ends_it(watch_term) -> None:
    term, endpoint = watch_term
    os.kill(term.pid, signal.SIGTERM)  # before the UI (or even Python) is up
    assert term.exit_status(timeout=GONE_S) in (-signal.SIGTERM, 128 + signal.SIGTERM)
    until(lambda: port_free(endpoint), 10, "port free")


# --- ddpscope replay -----------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real 2-rank run, recorded."""
    import subprocess

    record = tmp_path_factory.mktemp("replayed") / "rec"
    endpoint = f"ipc://{record.parent}/s.sock"
    cmd = torchrun_demo("--epochs", "2")
    env = job_env(DDPSCOPE_RECORD=str(record), DDPSCOPE_ENDPOINT=endpoint)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 or teardown_abort_only(proc), proc.stderr[-3000:]
    read_back(record)
    return record


@pytest.fixture
def replay_term(recorded: Path) -> Iterator[Terminal]:
    term = Terminal([*DDPSCOPE, "replay", str(recorded)], _env(), SIZE)
    yield term
    term.close()


def _replay_up(term: Terminal) -> None:
    term.wait_for("findings", timeout=60)


@pytest.mark.torchrun
@pytest.mark.parametrize("state", ["main-screen", "help-screen", "rank-detail", "go-to-prompt"])
def test_replay_whose_terminal_is_lost_exits(replay_term, recorded: Path, state: str) -> None:
    _replay_up(replay_term)
    _into(replay_term, state)
    replay_term.hang_up()
    assert replay_term.exit_status(timeout=GONE_S) == 128 + signal.SIGHUP
    read_back(recorded)  # a replay only reads


@pytest.mark.torchrun
@pytest.mark.parametrize("sig", STOP, ids=lambda s: s.name)
def test_a_stop_signal_ends_replay(replay_term, sig: signal.Signals) -> None:
    _replay_up(replay_term)
    _into(replay_term, "help-screen")
    os.kill(replay_term.pid, sig)
    assert replay_term.exit_status(timeout=GONE_S) == 128 + sig
