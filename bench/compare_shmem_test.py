"""compare_shmem.py on made-up CSV files: the best value over several runs of one side, and the targets."""
import contextlib
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_shmem  # noqa: E402

HEADER = "bench,impl,size,blocks,value,unit\n"


class Compare(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(prefix="compare-shmem-")

    def tearDown(self):
        self.dir.cleanup()

    def csv(self, name, rows):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            f.write(HEADER + "".join(f"{b},x,{s},{n},{v},{u}\n" for b, s, n, v, u in rows))
        return path

    def run_main(self, *args):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = compare_shmem.main(["compare_shmem.py", *args])
        return rc, out.getvalue()

    def test_best_is_the_highest_bandwidth_and_the_lowest_time_over_the_files(self):
        a = self.csv("a.csv", [("put_bw", 1 << 20, 32, 1500.0, "GBps"), ("put_bw", 1 << 20, 8, 400.0, "GBps"),
                               ("p_latency", 8, 1, 0.31, "us")])
        b = self.csv("b.csv", [("put_bw", 1 << 20, 32, 1700.0, "GBps"), ("put_bw", 1 << 20, 8, 390.0, "GBps"),
                               ("p_latency", 8, 1, 0.27, "us"), ("signal_latency_block", 8, 1, 1.4, "us")])
        best = compare_shmem.read_best(f"{a},{b}")
        self.assertEqual(best[("put_bw", 1 << 20, 32)], (1700.0, "GBps"))
        self.assertEqual(best[("put_bw", 1 << 20, 8)], (400.0, "GBps"))
        self.assertEqual(best[("p_latency", 8, 1)], (0.27, "us"))
        self.assertEqual(best[("signal_latency_block", 8, 1)], (1.4, "us"))  # a row only one file has
        self.assertEqual(compare_shmem.read_best(a), compare_shmem.read_rows(a))

    def test_a_row_in_two_units_is_refused(self):
        a = self.csv("a.csv", [("p_latency", 8, 1, 0.31, "us")])
        b = self.csv("b.csv", [("p_latency", 8, 1, 310.0, "ns")])
        with self.assertRaisesRegex(ValueError, "p_latency 8 B is in ns here and in us before"):
            compare_shmem.read_best(f"{a},{b}")

    def test_targets_are_judged_on_the_best_of_each_side(self):
        m1 = self.csv("m1.csv", [("put_bw_warp", 1 << 20, 32, 1680.0, "GBps")])
        m2 = self.csv("m2.csv", [("put_bw_warp", 1 << 20, 32, 1890.0, "GBps")])
        n1 = self.csv("n1.csv", [("put_bw_warp", 1 << 20, 32, 1860.0, "GBps")])
        n2 = self.csv("n2.csv", [("put_bw_warp", 1 << 20, 32, 1700.0, "GBps")])
        rc, out = self.run_main(m1, f"{n1},{n2}", "--strict", "--one-gpu")
        self.assertEqual(rc, 1)
        self.assertIn("put_bw_warp 1 MiB: below 1 x nvshmem", out)
        rc, out = self.run_main(f"{m1},{m2}", f"{n1},{n2}", "--strict", "--one-gpu")
        self.assertEqual(rc, 0, out)
        self.assertIn("targets missed: 0", out)
        self.assertRegex(out, r"put_bw_warp +1 MiB +best +1890\.00 +1860\.00 +GBps +1\.02 +ok")

    def test_a_missing_file_is_an_error_not_a_comparison(self):
        m = self.csv("m.csv", [("p_latency", 8, 1, 0.3, "us")])
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc, _ = self.run_main(f"{m},{m}.absent")
        self.assertEqual(rc, 1)
        self.assertIn("m.csv.absent", err.getvalue())


if __name__ == "__main__":
    unittest.main()
