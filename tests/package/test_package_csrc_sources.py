"""csrc/ stays free of iostreams: on the first GPU machine an `std::ifstream >>` inside _C.so
segfaulted in libstdc++'s locale machinery (docs/DESIGN.md, "No iostreams in csrc/"). Sources
use fopen/fgets/strtoll and std::to_string/snprintf instead; this test keeps it that way."""

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


def code_without_comments(text: str) -> str:
    """The source with comments blanked (newlines kept, so line numbers still match)."""
    def keep(match):
        token = match.group(0)
        if token.startswith("/"):
            return "\n" * token.count("\n")
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
