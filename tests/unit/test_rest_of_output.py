"""``helpers.rest_of_output``: what a process writes after a first ``readline`` of its output reaches the test
whole, however the output arrived. The drained-stream test of the multinode tier once lost the two events that
reached its pipe together with the first (read by ``Popen.communicate``, which bypasses the file object's
buffer) and compared a stream two tokens short with the reference."""
import subprocess
import sys

from helpers import rest_of_output

EVENTS = ["data: 1", "data: 2", "data: 3", "data: [DONE]"]
WRITER = "import sys; sys.stdout.write(''.join(e + '\\n\\n' for e in %r)); sys.stdout.flush()" % EVENTS


def events_after_first_line(read_rest):
    # every event is in the pipe before the first readline: that readline buffers all of them
    proc = subprocess.Popen([sys.executable, "-c", WRITER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stdout.readline()
    rest, _ = read_rest(proc)
    return [ln for ln in (first + rest).splitlines() if ln]


def test_every_event_after_the_first_line_arrives():
    assert events_after_first_line(lambda p: rest_of_output(p, timeout=60)) == EVENTS


def test_communicate_loses_what_readline_buffered():
    """Why the helper exists: the same process read as the test read it before."""
    def communicate(p):
        p.wait(60)  # all output is written: the first readline is sure to have buffered it
        return p.communicate(timeout=60)
    assert events_after_first_line(communicate) == EVENTS[:1]
