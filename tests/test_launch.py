"""The test launcher's report of a failed launch: the rank that failed first and how, each rank's first exception,
and where a rank that aborted was (faulthandler's stack), which the tails of long tracebacks from several ranks
would cut."""

import pytest

from tests.launch import torchrun

FAILING = """
import os, resource, signal, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")  # (as the workers do: their tracebacks' lines then name their rank)
if os.environ["RANK"] == "1":
    if sys.argv[1] == "signal":
        os.kill(os.getpid(), signal.SIGKILL)  # (as the kernel kills a process out of memory)
    if sys.argv[1] == "abort":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # (no core file, wherever core dumps are on)
        os.abort()  # (as C++'s std::terminate does after an uncaught exception)
    raise ValueError("rank 1 gave up")
time.sleep(60)  # stopped by the launcher once rank 1 has failed
"""


@pytest.mark.parametrize(("how", "said"), [("raise", ["forkrun: rank 1 exited with 1 first",
                                                       "rank 1: ValueError: rank 1 gave up"]),
                                            ("signal", ["forkrun: rank 1 was killed by SIGKILL first"]),
                                            ("abort", ["forkrun: rank 1 was killed by SIGABRT first",
                                                       "Fatal Python error: Aborted",
                                                       "Current thread 0x"])])
def test_a_failed_launch_names_the_rank_that_failed_first_and_its_error(tmp_path, how, said):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    with pytest.raises(AssertionError) as failed:
        torchrun(script, 2, how, timeout=120)
    first_lines = str(failed.value).splitlines()[1:1 + len(said)]
    assert [line.partition(";")[0][:len(expected)] for line, expected in zip(first_lines, said)] == said
    if how == "abort":  # where: faulthandler's stack of the aborting thread
        assert 'File "' + str(script) + '", line 10 in <module>' in str(failed.value)
