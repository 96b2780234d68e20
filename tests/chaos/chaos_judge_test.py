"""How chaos.py judges the survivors' naming of the dead PE, on made-up trials (no job runs)."""
import os
import sys
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chaos  # noqa: E402


def judge(victim, victim_gone, survivors, phase="steady"):
    """A trial whose rank `victim` was killed and ended `victim_gone` s later (None: not seen to end), with
    survivors {rank: (seconds to its end, PEs its runtime named, PEs the job named[, outcome[, seconds to its
    FAILED line]])}, each exiting with its FAILED line unless an outcome says otherwise; returns the trial after
    resolve_naming."""
    t = chaos.Trial.__new__(chaos.Trial)
    t.args = types.SimpleNamespace(phase=phase)
    t.victim = victim
    t.victim_gone = victim_gone
    t.problems = []
    t.survivors = {r: dict(outcome=(v[3] if len(v) > 3 else "ok"), seconds=v[0], runtime_names=set(v[1]),
                           job_names=set(v[2]), reported=(v[4] if len(v) > 4 else None))
                   for r, v in survivors.items()}
    t.resolve_naming()
    return t


class Naming(unittest.TestCase):
    def test_every_survivor_names_the_dead_pe(self):
        t = judge(1, 0.05, {0: (0.3, {1}, {1}), 2: (0.3, {1}, set()), 3: (0.4, set(), {1})})
        self.assertEqual(t.problems, [])
        self.assertEqual({r: i["named"] for r, i in t.survivors.items()}, {0: "direct", 2: "direct", 3: "direct"})

    def test_a_cascade_after_the_victim_was_gone_fails(self):
        t = judge(1, 1.0, {0: (2.2, {1}, {1}), 2: (2.2, {1}, set()), 3: (2.22, {2}, {2})})
        self.assertEqual([c for c, _ in t.problems], ["cascade"])
        self.assertEqual(t.survivors[3]["outcome"], "unnamed")

    def test_a_cascade_while_the_victim_was_still_there_is_counted(self):
        # The killed process had not ended when rank 3 did (never, within the wait; or after it).
        for gone in (None, 2.5):
            t = judge(1, gone, {0: (2.2, {1}, {1}), 2: (2.2, {1}, set()), 3: (2.22, {2}, {2})})
            self.assertEqual(t.problems, [], gone)
            self.assertEqual(t.survivors[3]["named"], "cascade before the death showed")
            self.assertEqual(t.survivors[3]["outcome"], "ok")

    def test_a_cascade_reported_before_the_victim_was_gone_is_counted_though_it_ended_after(self):
        # The CI run of a29e020: victim gone 1.98 s after the kill; ranks 1 and 2 reported before, ended after.
        t = judge(3, 1.98, {0: (2.19, {3}, set(), "ok", 2.1), 1: (2.13, {0}, {0}, "ok", 1.9),
                            2: (2.14, {0}, {0}, "ok", 1.9)})
        self.assertEqual(t.problems, [])
        self.assertEqual(t.survivors[1]["named"], "cascade before the death showed")
        # Reported after the victim was gone: a cascade fails.
        t = judge(3, 1.98, {0: (2.19, {3}, set(), "ok", 2.1), 1: (2.13, {0}, {0}, "ok", 2.0),
                            2: (2.14, {0}, {0}, "ok", 1.9)})
        self.assertEqual([c for c, _ in t.problems], ["cascade"])

    def test_naming_nobody_fails_even_before_the_victim_is_gone(self):
        t = judge(1, None, {0: (2.2, {1}, {1}), 2: (2.2, {1}, set()), 3: (2.22, set(), set())})
        self.assertEqual([c for c, _ in t.problems], ["unnamed"])

    def test_survivors_naming_only_each_other_fail(self):
        t = judge(0, 0.1, {1: (2.1, {2}, set()), 2: (2.1, {1}, set()), 3: (2.1, {0}, set())})
        self.assertEqual(sorted(c for c, _ in t.problems), ["unnamed", "unnamed"])

    def test_a_survivor_that_hung_is_not_judged_on_naming(self):
        t = judge(1, 0.1, {0: (None, {2}, set(), "hang"), 2: (2.2, {1}, set()), 3: (2.2, {1}, set())})
        self.assertEqual(t.problems, [])  # its hang is the failure, reported where it is found
        self.assertEqual(t.survivors[0]["named"], "cascade")


class PortListener(unittest.TestCase):
    SOCKETS = {11: "tcp 0100007F:6993 LISTEN", 12: "tcp 0100007F:6993 state 01", 13: "tcp 0100007F:6994 LISTEN"}

    def test_no_listener_on_the_port_is_no_leak(self):
        self.assertEqual(chaos.port_listener(27000, self.SOCKETS, {11: 5}), (None, None))

    def test_a_listener_another_process_holds_is_that_process_s(self):
        self.assertEqual(chaos.port_listener(0x6993, self.SOCKETS, {11: 4242, 12: 7}), (11, 4242))

    def test_a_listener_no_process_holds_is_a_leak(self):
        self.assertEqual(chaos.port_listener(0x6994, self.SOCKETS, {11: 4242}), (13, None))


if __name__ == "__main__":
    unittest.main()
