"""TensorFlow's C++ start-up lines kept off stderr in our processes (the CLI, the examples, the
test run), where TF_CPP_MIN_LOG_LEVEL does not reach them.

While `import tensorflow` loads its libraries, each writes lines through absl's logging before
absl is initialised (oneDNN's "custom operations are on" on x86 CPUs where oneDNN's ops are on,
as on Intel's by default or with TF_ENABLE_ONEDNN_OPTS=1; cpu_feature_guard's), and absl then
writes every message to stderr, with "WARNING: All log messages before absl::InitializeLog() is
called are written to STDERR", whatever TF_CPP_MIN_LOG_LEVEL says. So that import runs with file
descriptor 2 captured, and what it wrote goes back to stderr less the absl log lines (with
their continuation lines) below TF_CPP_MIN_LOG_LEVEL and, at a level above 0, absl's warning
about its own initialisation. A user's own TF_CPP_MIN_LOG_LEVEL is kept: at 0 every line shows."""

import os
import re
import sys
import tempfile

from ._import_hook import around_import

# absl's prefix: severity, MMDD, time (before absl starts, its seconds are since the epoch),
# thread id, file:line]
_LOG_LINE = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^\s\]]+:\d+\] ")
_BEFORE_INIT = "WARNING: All log messages before absl::InitializeLog() is called are written to"


def below_level(text: str, min_level: int) -> str:
    """text less absl's log lines (and their continuation lines) of a severity below min_level
    (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL, as TF_CPP_MIN_LOG_LEVEL) and, at a level above 0, its
    line about logging before InitializeLog."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        log = _LOG_LINE.match(line)
        if log:
            dropping = "IWEF".index(log.group(1)) < min_level
        elif line.startswith(_BEFORE_INIT):
            dropping = min_level > 0
        if not dropping:
            kept.append(line)
    return "".join(kept)


def _import_filtered(exec_module, module) -> None:
    min_level = int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") or 0)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            exec_module(module)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            rest = below_level(captured.read().decode(errors="replace"), min_level)
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()


def quiet_tensorflow_logs() -> None:
    """TensorFlow's C++ start-up lines off: TF_CPP_MIN_LOG_LEVEL=2 unless the user set it, and
    the lines written before absl's logging starts filtered by that level when TensorFlow is
    first imported (by anything: Keras imports it too). Imports nothing; call it before
    TensorFlow is imported."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    around_import("tensorflow", _import_filtered)
