"""The launcher's reading of torchrun's failure summary (no processes started)."""

from runtime.launch import root_cause

SUMMARY = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
runtime.worker FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_19:19:08
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 16209)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 16209
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_19:19:08
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 16210)
  error_file: <N/A>
  traceback : {trace}
=======================================================
"""


def test_rank_killed_by_a_signal_is_the_root_cause():
    text = SUMMARY.format(rank=3, code=-9, trace="Signal 9 (SIGKILL) received by PID 16210")
    assert root_cause(text) == (3, "killed by SIGKILL (out of memory?)", True)


def test_a_plain_exit_code_is_not_taken_for_a_signal():
    text = SUMMARY.format(rank=1, code=1, trace="To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    rank, what, by_signal = root_cause(text)
    assert (rank, by_signal) == (1, False) and what.startswith("exited with code 1")


def test_no_summary():
    assert root_cause("all went well") is None
