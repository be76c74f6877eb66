"""kvmesh.kvstore.log_once: each cause is a warning once, then debug lines; causes are per owner."""
import logging

from kvmesh.kvstore.log_once import LogOnce

log = logging.getLogger("kvmesh.test.log_once")


def test_each_cause_warns_once_then_logs_at_debug_and_owners_do_not_share_causes(caplog):
    once, other = LogOnce(log), LogOnce(log)
    with caplog.at_level(logging.DEBUG, logger=log.name):
        for cause in ("io", "io", "timeout", "io"):
            once(cause, "store object %s failed (%s)", "b/00ff", cause)
        other("io", "again elsewhere")
    got = [(r.levelname, r.getMessage().removeprefix("store object b/00ff ")) for r in caplog.records]
    assert got == [("WARNING", "failed (io)"), ("DEBUG", "failed (io)"), ("WARNING", "failed (timeout)"),
                   ("DEBUG", "failed (io)"), ("WARNING", "again elsewhere")]
    assert caplog.records[0].funcName.startswith("test_each_cause")      # the caller's line, not the helper's
    assert not once.first("io") and once.first("new")
