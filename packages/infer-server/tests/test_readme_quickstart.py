"""README's quickstart, as a new user meets it (issue 14, "the first ten minutes"): its `openai`
snippet runs as written against a real server on the default model and ends its answer, and the
token limit a request gets when it sends no `max_tokens` is what README says.

The snippet and the numbers are read from README.md, never copied here, so an edit there that
breaks them fails here.
"""

import ast
import contextlib
import io
import json
import re
import time
from pathlib import Path

README = Path(__file__).resolve().parents[3] / "README.md"
# Where README's snippet points; replaced by the test server's address.
README_BASE_URL = "http://127.0.0.1:8000/v1"


def readme_text() -> str:
    return README.read_text()


def readme_prose() -> str:
    """README with its line breaks and indentation folded into single spaces, for sentences."""
    return " ".join(readme_text().split())


def fenced_blocks(text: str, languages: set[str]) -> list[str]:
    """The bodies of the markdown fenced blocks whose info string is one of `languages`."""
    return [
        match["body"]
        for match in re.finditer(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", text, re.MULTILINE | re.DOTALL)
        if match["lang"] in languages
    ]


def readme_openai_snippet() -> str:
    snippets = [block for block in fenced_blocks(readme_text(), {"python"}) if "OpenAI(" in block]
    assert len(snippets) == 1, f"README.md should hold one python block using OpenAI(, found {len(snippets)}"
    return snippets[0]


def create_call_keywords(snippet: str) -> dict[str, ast.expr]:
    """The keyword arguments of the snippet's one `client.chat.completions.create(...)` call."""
    calls = [
        node
        for node in ast.walk(ast.parse(snippet))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "create"
    ]
    assert len(calls) == 1, f"README's openai snippet should make one create() call, found {len(calls)}"
    return {keyword.arg: keyword.value for keyword in calls[0].keywords}


def documented_number(pattern: str) -> int:
    """The number that `pattern` (one group) finds in README's prose; fails naming the pattern."""
    found = re.search(pattern, readme_prose())
    assert found is not None, f"README.md no longer says {pattern!r}: update this test with the docs"
    return int(found.group(1))


def test_readme_openai_snippet_answers_on_the_default_model(server):
    snippet = readme_openai_snippet()
    keywords = create_call_keywords(snippet)
    assert "max_tokens" in keywords, "README's openai snippet must pass max_tokens (issue 14)"
    max_tokens = ast.literal_eval(keywords["max_tokens"])
    assert ast.literal_eval(keywords["model"]) == server.model  # the default model's name
    assert README_BASE_URL in snippet, f"README's openai snippet no longer uses {README_BASE_URL}"
    code = snippet.replace(README_BASE_URL, f"{server.base_url}/v1")

    printed, namespace = io.StringIO(), {"__name__": "readme_snippet"}
    started = time.monotonic()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), namespace)
    elapsed = time.monotonic() - started

    answer = printed.getvalue()
    last_chunk = namespace["chunk"]  # the snippet's loop variable: the stream's final chunk
    assert last_chunk.choices[0].finish_reason == "stop", (
        f"README's snippet did not end its answer within max_tokens={max_tokens}: {answer!r}"
    )
    assert "Paris" in answer, f"README's question was not answered: {answer!r}"
    assert elapsed < 60, f"README's snippet took {elapsed:.0f} s"


def test_chat_without_max_tokens_may_run_to_the_end_of_the_context(start_server):
    # README: "its token limit is `--max-seq-len` minus the prompt's tokens".
    rule = "its token limit is `--max-seq-len` minus the prompt's tokens"
    assert rule in readme_prose(), f"README.md no longer says {rule!r}: update this test with the docs"
    max_seq_len = 64  # small, so that running to the end of the context is quick
    running = start_server(max_seq_len=max_seq_len, max_batch_size=1)
    reply = running.openai_client().chat.completions.create(
        model=running.model,
        messages=[{"role": "user", "content": "Count from one to one thousand."}],
        temperature=0,
        extra_body={"ignore_eos": True},  # the worst case: a model that never ends its answer
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == max_seq_len


def test_default_context_is_the_models_capped_at_the_documented_number(start_server, smollm2_loaded):
    cap = documented_number(r"`--max-seq-len` defaults to the model's context capped at (\d+) tokens")
    config = json.loads((Path(smollm2_loaded.path) / "config.json").read_text())
    model_context = config["max_position_embeddings"]
    assert model_context > cap  # SmolLM2 takes 8192: the cap is what this test sees
    running = start_server(max_seq_len=None, max_batch_size=1)  # as `infer serve` without the flag
    (model,) = running.openai_client().models.list().data
    assert model.model_extra["max_model_len"] == min(model_context, cap)


def test_completion_without_max_tokens_stops_at_the_documented_default(server):
    default = documented_number(r"A completion without `max_tokens` stops at (\d+) tokens")
    reply = server.openai_client().completions.create(
        model=server.model, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == default


def test_fenced_blocks_reads_markdown_fences():
    """The block parser the tests above rely on (a guard for its regex)."""
    text = "text\n```python\nx = 1\n```\n```console\n$ ls\n```\n"
    assert fenced_blocks(text, {"python"}) == ["x = 1\n"]
    assert fenced_blocks(text, {"console"}) == ["$ ls\n"]
