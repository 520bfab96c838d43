"""Every documented command is a test: each fenced ``bash`` and ``python`` block of README.md and
docs/*.md runs as written, one test per block (ids ``README.md:139-bash``: file, line of the
opening fence, language), in the order of the file. A bash block fails on a non-zero exit
(``bash -e -o pipefail``), a python block on an exception; either fails when it leaves a process
or a /dev/shm file of its own behind. What may differ from the text (tests/e2e/doc_runner.py):
the documented ports (8000, 5555, 7600, ...) become free ports, paths under /tmp, /var/cache and
/etc move under a directory of the block's section, and ENGINE_TEST_MAX_TOKENS (a test-only
variable, engine/envs.py) caps every request's generation length. Nothing else is edited
(``make run`` reads its port from the Makefile's PORT, which the runner sets like a port in the
text). Blocks that use the optional Mooncake backend skip, saying why, where it cannot load.

Markers: an HTML comment (it does not render) on the line directly above a block, one per block,
items separated by spaces:

- ``<!-- doc-test: server="http://127.0.0.1:8000/health" -->``: the block starts a long-running
  server. It runs in the background, and the next block runs once every URL given answers
  (``http://...``: a 200; ``tcp://HOST:PORT``: a connection; none given: at once). It runs
  until the end of its section (the next heading at the level of the heading above it, so a
  section's subsections run against it too); every block in between runs while it serves. Then
  a step ``<id>-stop`` sends SIGTERM to the server (under its shell and ``make``): it must exit
  0 and leave no process and no /dev/shm file behind.
- ``<!-- doc-test: skip="needs a GPU" -->``: not run; reported as a skip with that reason (a
  GPU, a second host, minutes of run time, a fragment with ``...``). A server's skip (and
  slow) carries over to every block of its section.
- ``<!-- doc-test: slow -->``: runs under ``pytest -m slow`` only.
- ``<!-- doc-test: stdin="What is the capital of France?" -->``: the block's standard input
  (``\\n`` separates lines; a newline ends it); without it the input is empty.

A marker with an unknown name, or one that is not directly above a bash or python block, fails
collection. tests/e2e/conftest.py prints each block's outcome (and each skip's reason) at the
end of the run.
"""

from __future__ import annotations

import pytest
from doc_runner import (
    REPO,
    DocError,
    DocFailure,
    DocSkip,
    Session,
    parse_markdown,
    plan,
    plan_files,
    run_markdown,
)

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
STEPS = plan_files(DOCS)


def _param(step):
    marks = []
    if step.skip:
        marks.append(pytest.mark.skip(reason=step.skip))
    if step.slow:
        marks.append(pytest.mark.slow)
    return pytest.param(step, id=step.id, marks=marks)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    s = Session(tmp_path_factory.mktemp("docs"))
    yield s
    s.close()


@pytest.mark.parametrize("step", [_param(s) for s in STEPS])
def test_block(step, session):
    try:
        session.run(step)
    except DocSkip as exc:
        pytest.skip(str(exc))
    except DocFailure as exc:
        pytest.fail(str(exc), pytrace=False)


NEGATIVE = """# A page that drifted from the code

```bash
.venv/bin/engine generate --model default --no-such-flag
```

```python
print("this block is fine")
```

```python
import engine

engine.no_such_function()
```

## A server

<!-- doc-test: server="http://127.0.0.1:8000/health" -->
```bash
.venv/bin/engine serve --port 8000 --no-such-flag
```

```bash
curl -sf http://127.0.0.1:8000/health
```
"""


def test_a_block_that_drifted_fails(tmp_path):
    """The negative control: a wrong flag (a block, a server), an exception in a python block."""
    md = tmp_path / "drifted.md"
    md.write_text(NEGATIVE)
    results = run_markdown(md, tmp_path / "run")
    got = [(r.step, r.outcome) for r in results]
    assert got == [
        ("drifted.md:3-bash", "failed"),
        ("drifted.md:7-python", "passed"),
        ("drifted.md:11-python", "failed"),
        ("drifted.md:20-bash", "failed"),
        ("drifted.md:24-bash", "skipped"),
        ("drifted.md:20-bash-stop", "skipped"),
    ], results
    assert "exited with 2" in results[0].message and "--no-such-flag" in results[0].message
    assert "AttributeError" in results[2].message
    assert "exited with 2 before it was ready" in results[3].message
    assert "drifted.md:20-bash did not start" in results[4].message


def test_markers_and_sections(tmp_path):
    md = tmp_path / "page.md"
    md.write_text(
        "# Page\n\n## Serve\n\n"
        '<!-- doc-test: server="tcp://127.0.0.1:5555" slow -->\n```bash\nserve\n```\n\n'
        "### Sub\n\n```python\nclient()\n```\n\n"
        "## Other\n\n"
        '<!-- doc-test: skip="needs a GPU" -->\n```bash\ngpu\n```\n\n'
        "```sh\nnot run: not bash\n```\n"
    )
    steps = plan(parse_markdown(md))
    assert [(s.id, s.slow, s.skip) for s in steps] == [
        ("page.md:6-bash", True, None),
        ("page.md:12-python", True, None),  # the subsection runs against the server
        ("page.md:6-bash-stop", True, None),
        ("page.md:19-bash", False, "needs a GPU"),
    ]
    assert steps[1].servers == (steps[0].block,)
    for bad in (
        "<!-- doc-test: skp -->\n```bash\nx\n```\n",
        '<!-- doc-test: slow="yes" -->\n```bash\nx\n```\n',
        "<!-- doc-test: skip -->\n```bash\nx\n```\n",
        "<!-- doc-test: slow -->\n\nsome prose\n\n```bash\nx\n```\n",
        "<!-- doc-test: slow -->\n```text\nx\n```\n",
    ):
        md.write_text(bad)
        with pytest.raises(DocError):
            parse_markdown(md)


def test_substitutions_are_ports_and_directories_only(tmp_path):
    s = Session(tmp_path)
    block = parse_markdown(_write(tmp_path, "```bash\nx\n```\n"))[0]
    text = (
        "engine serve --port 8000 --kv-pool 'dram=1GiB,ssd=/var/cache/kv:50GiB,"
        "tcp://127.0.0.1:7600' && curl http://127.0.0.1:8000/v1 --max 8000.5 /tmp/kv ~/tmp/x\n"
    )
    out = s.substitute(text, block)
    p8000, p7600 = s.ports[8000], s.ports[7600]
    root = tmp_path / "dirs" / "page.md-s0"
    assert out == (
        f"engine serve --port {p8000} --kv-pool 'dram=1GiB,ssd={root}/var/cache/kv:50GiB,"
        f"tcp://127.0.0.1:{p7600}' && curl http://127.0.0.1:{p8000}/v1 --max 8000.5 "
        f"{root}/tmp/kv ~/tmp/x\n"
    )


def _write(tmp_path, text):
    md = tmp_path / "page.md"
    md.write_text(text)
    return md


def test_the_docs_have_blocks():
    ids = [s.id for s in STEPS]
    assert len(ids) == len(set(ids)) and any(i.startswith("README.md:") for i in ids)
