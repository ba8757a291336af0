"""What `quantkit verify` found: one section per check, a verdict and its exit code.

Why its own module: the engine checks, the CLI and `quantize --verify` share it, and none of
them may import the others.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Check", "VerifyResult", "EXIT_VERIFIED", "EXIT_WRONG", "EXIT_ENGINE_CANNOT_RUN",
           "PASS", "FAIL", "NOT_CHECKED"]

EXIT_VERIFIED, EXIT_WRONG, EXIT_ENGINE_CANNOT_RUN = 0, 1, 3
PASS, FAIL, NOT_CHECKED = "pass", "FAIL", "not checked"


@dataclass
class Check:
    """One row of the table: its status, one line of what was measured, what is wrong."""
    name: str
    status: str = NOT_CHECKED
    summary: str = ""
    problems: list[str] = field(default_factory=list)
    measured: dict = field(default_factory=dict)

    def fail(self, where: str, what: str) -> None:
        self.problems.append(f"{where}: {what}")
        self.status = FAIL

    def done(self, summary: str) -> None:
        self.summary = summary
        if self.status != FAIL:
            self.status = PASS

    def skip(self, why: str) -> None:
        self.status, self.summary = NOT_CHECKED, why


@dataclass
class VerifyResult:
    artifact: str
    engine: str
    format: str
    source: str | None = None
    engine_version: str = ""
    kernel: str = ""
    dtype: str = ""
    engine_cannot_run: str | None = None  # why the engine cannot run this scheme here
    checks: dict[str, Check] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def check(self, name: str) -> Check:
        return self.checks.setdefault(name, Check(name))

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks.values())

    @property
    def exit_code(self) -> int:
        if not self.ok:
            return EXIT_WRONG
        return EXIT_ENGINE_CANNOT_RUN if self.engine_cannot_run else EXIT_VERIFIED

    @property
    def verdict(self) -> str:
        if not self.ok:
            bad = [c.name for c in self.checks.values() if c.status == FAIL]
            return f"WRONG ({', '.join(bad)})"
        if self.engine_cannot_run:
            return f"not verified in {self.engine}: {self.engine_cannot_run}"
        return "verified"

    def first_problem(self) -> str:
        return next((p for c in self.checks.values() for p in c.problems), "")

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "exit_code": self.exit_code, "verdict": self.verdict}

    def summary(self) -> dict:
        """What quantize --verify keeps in quantkit.json and compare shows (report.rows)."""
        message = self.first_problem() or self.verdict
        return {"ok": self.ok and not self.engine_cannot_run, "engine": self.engine,
                "message": message, "verdict": self.verdict, "exit_code": self.exit_code,
                "checks": {n: c.status for n, c in self.checks.items()},
                "engine_version": self.engine_version, "kernel": self.kernel, "dtype": self.dtype}

    def rows(self) -> list[tuple[str, str, str]]:
        """(check, status, what was measured) for the table."""
        out = [(c.name, c.status, c.summary) for c in self.checks.values()]
        out += [("engine version", "", self.engine_version or "-"),
                ("kernel", "", self.kernel or "-"), ("dtype", "", self.dtype or "-")]
        return out
