"""What the differential fuzzers (scripts/fuzz_decode.py, scripts/fuzz_prefill.py) share: their
common options, the Triton interpreter switch, a forked CPU session with a time limit, CUDA-error
detection, exception messages as counter keys, and the seed loop with its progress lines and its
closing JSON summary. Imports neither torch nor flashdispatch (TRITON_INTERPRET comes first)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import sys
import time
import traceback

CUDA_FATAL = re.compile(r"CUDA error|CUDA_ERROR|cudaError|illegal memory access|device-side assert|misaligned address"
                        r"|unspecified launch failure|Triton Error \[CUDA\]|CUBLAS_STATUS|an illegal instruction")
# a page check refusing indices: never right, the fuzzers' indices fit their cache (a grown one too)
PAGE_CHECK = re.compile(r"reference page \d+, but paged_kv_cache has only")
EXIT_CUDA = 3  # the exit status after a CUDA error (a driver loop restarts at the summary's next_seed)


class Timeout(BaseException):
    """SIGALRM: a session ran past its time limit (no case's ``except Exception`` takes it)."""


class CudaFatal(BaseException):
    """A CUDA error: the context is lost, the process must end (no ``except Exception`` takes it)."""


def argv_device() -> str:
    """The --device of the command line (default cpu), read before argparse runs."""
    argv = sys.argv[1:]
    dev = next((a.split("=", 1)[1] for a in argv if a.startswith("--device=")), None)
    return dev or (argv[argv.index("--device") + 1] if "--device" in argv[:-1] else "cpu")


def use_interpreter(device: str) -> None:
    """Switch the Triton interpreter on for the CPU (before Triton is imported); refuse it on CUDA."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit(f"{os.path.basename(sys.argv[0])}: unset TRITON_INTERPRET for --device cuda")


def parse_args(doc: str, minutes: float, out: str, dtypes: str, cpu_dtypes: str, cuda_dtypes: str,
               more: tuple = ()) -> argparse.Namespace:
    """The command line: the options of both fuzzers and ``more`` ((flag, add_argument keywords)
    pairs); ``out`` the default --out ({device}: --device), --dtypes a list of ``dtypes`` (checked),
    --scale and --dtypes defaulted by --device."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0], allow_abbrev=False)  # (argv_device reads --device)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--minutes", type=float, default=minutes)
    ap.add_argument("--sessions", type=int, default=0, help="stop after this many sessions (0: at --minutes)")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--stride", type=int, default=1, help="seed step (parallel runs: --start i --stride n)")
    ap.add_argument("--replay", type=int, default=None, metavar="SEED", help="run one session in-process, verbosely")
    ap.add_argument("--dry-run", type=int, default=0, metavar="N", help="print N generated specs, run nothing")
    ap.add_argument("--out", default=out, help=f"failures JSONL, appended (default {out.format(device='DEVICE')})")
    ap.add_argument("--dtypes", default=None, help=f"of {dtypes} (bf16 on cuda only; default cpu: {cpu_dtypes}, "
                                                   f"cuda: {cuda_dtypes})")
    ap.add_argument("--scale", choices=["small", "large"], default=None, help="default cpu: small, cuda: large")
    for flag, kw in more:
        ap.add_argument(flag, **kw)
    args = ap.parse_args()
    if args.stride < 1:
        ap.error(f"--stride {args.stride}: must be >= 1")
    cuda = args.device == "cuda"
    args.out = args.out.format(device=args.device)
    args.scale = args.scale or ("large" if cuda else "small")
    args.dtypes = (args.dtypes or (cuda_dtypes if cuda else cpu_dtypes)).split(",")
    if not set(args.dtypes) <= set(dtypes.split(",")) or (not cuda and "bf16" in args.dtypes):
        ap.error(f"--dtypes {args.dtypes}: of {dtypes}, bf16 on cuda only (the interpreter computes bf16 wrongly)")
    return args


def replay_command(script: str, args: argparse.Namespace, seed: int) -> str:
    """The command that replays ``seed`` with the options that found it (in failure records)."""
    return (f"scripts/{script} --device {args.device} --scale {args.scale} --dtypes {','.join(args.dtypes)} "
            f"--replay {seed}")


def append_jsonl(path: str, records: list[dict]) -> None:
    """Append ``records`` (if any) to the JSONL file ``path``, its folder made."""
    if not records:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


@contextlib.contextmanager
def time_limit(seconds: int):
    """Raise Timeout (SIGALRM) in the block after ``seconds`` (0: no limit)."""
    def on_alarm(signum, frame):
        raise Timeout(f"session exceeded {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_forked(work, timeout: float) -> tuple[object, str]:
    """``work()`` in a forked child (a crash or a hang of the interpreter must not end the fuzzer),
    its JSON result sent back: (result, "") or (None, why): "timeout" where the child was killed
    after ``timeout`` s, else its wait status."""
    rfd, wfd = os.pipe()
    if (pid := os.fork()) == 0:  # the child: run, send the result, exit without cleanup
        os.close(rfd)
        status = 1  # no result: the parent reports the wait status
        try:
            data = json.dumps(work()).encode()
            while data:
                data = data[os.write(wfd, data):]
            status = 0
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            os._exit(status)
    os.close(wfd)
    data, deadline, chunk, timed_out = b"", time.time() + timeout, b".", False
    while chunk and not timed_out:
        timed_out = not select.select([rfd], [], [], max(0.0, deadline - time.time()))[0]
        chunk = b"" if timed_out else os.read(rfd, 1 << 16)
        data += chunk
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    os.close(rfd)
    status = os.waitpid(pid, 0)[1]
    if timed_out:
        return None, "timeout"
    try:
        return json.loads(data), ""
    except ValueError:  # nothing, or a result cut short (the child killed while writing it)
        return None, f"no result ({len(data)} bytes), wait status {status}"


def is_cuda_error(e: BaseException) -> bool:
    """Whether ``e`` names a CUDA error or the device fails a synchronisation now (a lost context)."""
    import torch  # (imported already: the caller ran on a device)
    try:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        return True
    return bool(CUDA_FATAL.search(str(e)))


def norm_msg(e: BaseException, tb: bool = False) -> str:
    """An exception's type and first line, numbers as N (alike errors share a counter key); ``tb``:
    and its last frames."""
    first = (str(e).strip().splitlines() or [""])[0]
    m = re.sub(r"(?<![\w.])-?\d+(\.\d+)?(e[-+]?\d+)?", "N", f"{type(e).__name__}: {first}")[:200]
    return m + "\n" + "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:]) if tb else m


def refusal_key(e: BaseException) -> str:
    """`norm_msg` of a refusal, and for an `Unsupported` the codes of its reasons per backend
    ("| fa2: head_dim"): the summary's refusal counts then say why each one refused."""
    reasons = getattr(e, "reasons", None) or {}
    codes = "; ".join(f"{backend}: {','.join(sorted({r.code for r in rs}))}" for backend, rs in reasons.items())
    return norm_msg(e) + (f" | {codes}" if codes else "")


class SeedLoop:
    """The seeds from --start by --stride: --sessions of them, else as many as --minutes allow (one
    at least); every ``every`` s a progress line. ``next_seed``: where a later run goes on."""

    def __init__(self, args: argparse.Namespace, every: float, progress):
        self.args, self.every, self.progress = args, every, progress  # progress(): the line's text
        self.t0 = self.last_print = time.time()
        self.next_seed = args.start

    def elapsed(self) -> float:
        """Seconds since the loop began."""
        return time.time() - self.t0

    def __iter__(self):
        a = self.args
        while True:
            n = (self.next_seed - a.start) // a.stride
            if (n >= a.sessions) if a.sessions else (n > 0 and self.elapsed() >= a.minutes * 60):
                return
            seed = self.next_seed
            self.next_seed += a.stride
            yield seed
            if time.time() - self.last_print > self.every:
                self.last_print = time.time()
                print(f"[{self.elapsed():6.0f}s] next seed {self.next_seed} {self.progress()}", flush=True)


def off_by(what: str, got, want, bound) -> list[str]:
    """A problem where |got - want| > bound (NaN included) anywhere."""
    diff, inf = (got - want).abs(), float("inf")
    bad = ~(diff <= bound)
    if not bad.any():
        return []
    i = int((diff.nan_to_num(inf) - bound).flatten().argmax())
    return [f"{what}: {int(bad.sum())}/{bad.numel()} off, max abs err {float(diff.nan_to_num(inf).max()):.4g}; "
            f"at flat {i}: got {float(got.flatten()[i]):.5g} want {float(want.flatten()[i]):.5g}"]


def finish(summary: dict, code: int) -> int:
    """Print the JSON summary (the last stdout line); the exit status: ``code`` (EXIT_CUDA), else 1
    on failures, else 0."""
    print(json.dumps(summary), flush=True)
    return code or (1 if summary["failures"] else 0)
