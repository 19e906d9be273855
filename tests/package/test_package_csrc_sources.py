"""Rules on csrc/'s sources.

No iostreams: on the first GPU machine an `std::ifstream >>` inside _C.so segfaulted in libstdc++'s
locale machinery (docs/DESIGN.md, "No iostreams in csrc/"). Sources use fopen/fgets/strtoll and
std::to_string/snprintf instead.

Torch's headers only where the source binds to torch: they cost most of a build (torch/extension.h
alone takes about 30 CPU seconds a source), so only the operators' sources include ATen and only
module.cpp includes the Python side; everything else is plain C++."""

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCE_SUFFIXES = {".cpp", ".cc", ".cxx", ".h", ".hpp", ".cu", ".cuh"}

# Headers that declare streams (and so pull the locale-dependent extraction/insertion templates in).
BANNED_HEADERS = ("iostream", "istream", "ostream", "sstream", "fstream", "iomanip", "strstream",
                  "spanstream", "syncstream")
BANNED_INCLUDE = re.compile(r"^\s*#\s*include\s*<(" + "|".join(BANNED_HEADERS) + r")>", re.MULTILINE)
# Stream types and objects, reached through another header (torch's, say) even without an include.
BANNED_USE = re.compile(
    r"\bstd::(?:__cxx11::)?(?:basic_)?(?:[io]?stringstream|[io]?fstream|stringbuf|filebuf|[io]stream"
    r"|w?cout|w?cerr|w?clog|w?cin|getline)\b")

# String and character literals are kept (as empty quotes) so that comment markers inside them are
# not taken for comments; comments are dropped, so a comment may name what it warns against.
_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.DOTALL)


def code_without_comments(text: str, keep_strings: bool = False) -> str:
    """The source with comments blanked (newlines kept, so line numbers still match), and string
    literals emptied unless keep_strings."""
    def keep(match):
        token = match.group(0)
        if token.startswith("/"):
            return "\n" * token.count("\n")
        if keep_strings:
            return token
        return '""' if token.startswith('"') else "''"
    return _TOKEN.sub(keep, text)


def stream_uses(text: str) -> list:
    """['line N: what'] for every banned include or stream use in one source text."""
    code = code_without_comments(text)
    found = []
    for pattern in (BANNED_INCLUDE, BANNED_USE):
        for match in pattern.finditer(code):
            line = code.count("\n", 0, match.start()) + 1
            found.append(f"line {line}: {match.group(0).strip()}")
    return found


def csrc_sources() -> list:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in SOURCE_SUFFIXES)


def test_csrc_has_sources():
    names = {p.name for p in csrc_sources()}
    assert {"host_arena.cpp", "copy_engine.cpp", "file_store.cpp"} <= names, names


@pytest.mark.parametrize("source", csrc_sources(), ids=lambda p: p.name)
def test_no_iostreams_in_csrc(source):
    found = stream_uses(source.read_text())
    assert not found, (f"{source.relative_to(CSRC.parent)} uses iostreams ({'; '.join(found)}): read files "
                       "with fopen/fgets/strtoll and build messages with std::to_string/snprintf "
                       "(docs/DESIGN.md, 'No iostreams in csrc/')")


@pytest.mark.parametrize("snippet", [
    "#include <fstream>\n", "  #  include <sstream>\n", "#include <iostream>\n", "#include <ostream>\n",
    "std::ostringstream msg;\n", "std::ifstream in(path);\n", "std::cerr << x;\n", "std::cout << 1;\n",
    "std::stringstream s;\n", "std::basic_ofstream<char> f;\n", "std::__cxx11::ostringstream m;\n",
    "std::getline(in, line);\n", 'x = "a"; std::wcerr << 1;\n',
])
def test_the_scan_catches_stream_uses(snippet):
    assert stream_uses("int a;\n" + snippet), snippet


@pytest.mark.parametrize("snippet", [
    "// std::ifstream >> was the crash\n", "/* #include <sstream>\n std::cout */\n",
    'msg = "std::ostringstream";\n', "_mm_stream_si128(p, a);\n", "copy_streaming(d, s, n);\n",
    "#include <cstdio>\n", "cudaStream_t stream;\n", "std::string upstream;\n",
])
def test_the_scan_ignores_comments_strings_and_lookalikes(snippet):
    assert stream_uses(snippet) == [], snippet


def test_comment_blanking_keeps_line_numbers():
    text = "/* one\n two */\nstd::cout << 1; // three\n"
    assert stream_uses(text) == ["line 3: std::cout"]


# ---- torch's headers only where needed

# The sources that bind to torch's dispatcher (ATen tensors, torch.library); every other source is
# plain C++.
TORCH_SOURCES = {"adam.cpp", "grad_norms.cpp", "ops.cpp", "module.cpp"}
# The one source that binds to Python (pybind11, torch's Python headers).
PYTHON_SOURCES = {"module.cpp"}
TORCH_HEADER = re.compile(r'^\s*#\s*include\s*[<"]((?:torch|ATen|c10|pybind11)/[^>"]*|Python\.h)[>"]', re.MULTILINE)
PYTHON_HEADER = re.compile(r"^(?:pybind11/|torch/csrc/|torch/extension\.h|torch/python\.h|Python\.h)")
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def torch_headers(source: Path, root: Path = CSRC) -> set:
    """The torch, ATen, c10, pybind11 and Python headers that `source` includes, directly or
    through the headers of `root` (csrc/) it includes."""
    found, seen, todo = set(), set(), [source]
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():  # generated headers (build/generated) hold no includes
            continue
        seen.add(path)
        code = code_without_comments(path.read_text(), keep_strings=True)
        found |= {m.group(1) for m in TORCH_HEADER.finditer(code)}
        todo += [root / name for name in LOCAL_INCLUDE.findall(code)]
    return found


def compiled_sources() -> list:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".cu"))


@pytest.mark.parametrize("source", compiled_sources(), ids=lambda p: p.name)
def test_only_the_binding_sources_include_torch_headers(source):
    headers = torch_headers(source)
    if source.name not in TORCH_SOURCES:
        assert not headers, (f"csrc/{source.name} includes {sorted(headers)}: only the sources that bind to "
                             f"torch ({', '.join(sorted(TORCH_SOURCES))}) include torch's headers")
    python = {h for h in headers if PYTHON_HEADER.match(h)}
    if source.name not in PYTHON_SOURCES:
        assert not python, (f"csrc/{source.name} includes {sorted(python)}: only module.cpp binds to Python; "
                            "declare what the binding needs in a plain header and bind it there")


def test_the_header_scan_follows_local_includes(tmp_path):
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\n#include "generated.h"\n')
    (tmp_path / "b.h").write_text("// #include <torch/extension.h>\n#include <ATen/core/Tensor.h>\n")
    (tmp_path / "s.cpp").write_text('#include "a.h"\n#include <cstdint>\n#include <pybind11/pybind11.h>\n')
    assert torch_headers(tmp_path / "s.cpp", tmp_path) == {"ATen/core/Tensor.h", "pybind11/pybind11.h"}
