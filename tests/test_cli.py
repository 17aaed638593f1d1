"""The `octavo` command line, run as a user runs it (a subprocess), on real files.

The SmolLM2 compile (shared fixture) shows dumps, a valid ONNX graph and the
paged rewrite; tiny artifacts show generate; bad inputs each give one clear
`error: ` line on stderr, a non-zero exit and nothing written.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnx
import pytest
import torch

from octavo.frontend.architectures import ARCHITECTURES
from octavo.ir.artifact_format import FORMAT_VERSION
from octavo.llm import LLM
from octavo.passes.registry import resolve_pipeline
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full, run_cli

TINY_PROMPT = "Once upon a time"


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    return {str(file.relative_to(path)): (file.stat().st_mtime_ns, file.stat().st_size)
            for file in sorted(path.rglob("*"))}


def apply_unified_diff(before: list[str], hunks: list[str]) -> list[str]:
    """`before` patched by the hunks of a unified diff (`@@ -start,count +start,count @@`, then lines tagged
    " " context, "-" removed, "+" added); every context and removed line must match `before`."""
    result, position, index = [], 0, 0
    while index < len(hunks):
        header = re.fullmatch(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@\n", hunks[index])
        assert header, f"not a hunk header: {hunks[index]!r}"
        start, count = int(header.group(1)), int(header.group(2) or 1)
        first = start - 1 if count else start  # an empty range names the line after which the hunk goes
        assert first >= position, "hunks overlap or go backwards"
        result += before[position:first]
        position, index = first, index + 1
        while index < len(hunks) and not hunks[index].startswith("@@"):
            tag, text = hunks[index][0], hunks[index][1:]
            assert tag in " -+", f"bad diff line {hunks[index]!r}"
            if tag in " -":
                assert before[position] == text, f"diff line {hunks[index]!r} does not match line {position + 1}"
                position += 1
            if tag in " +":
                result.append(text)
            index += 1
    return result + before[position:]


def test_every_command_answers_help_without_loading_torch_the_server_or_transformers():
    """The parser of every command is built from light modules: `octavo X --help` (and a bad argument) answer
    at once; each command imports what it runs when it runs."""
    script = ("import contextlib, io, sys\n"
              "from octavo.cli import build_parser, main\n"
              "parser = build_parser()\n"
              "commands = list(parser._subparsers._group_actions[0].choices)\n"
              "for command in commands:\n"
              "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
              "        main([command, '--help'])\n"
              "    assert command in out.getvalue(), command\n"
              "print(' '.join(commands))\n"
              "print(' '.join(sorted({'torch', 'fastapi', 'transformers', 'onnx'} & set(sys.modules))))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    commands, loaded = result.stdout.splitlines()
    assert set(commands.split()) >= {"compile", "generate", "chat", "inspect", "bench", "eval", "warmup", "demo",
                                     "serve"}
    assert loaded == "", f"building the parser and printing every --help imported {loaded}"


@pytest.mark.parametrize(("args", "message"), [
    (["bench", "A", "--num-requests", "0"], "argument --num-requests: must be >= 1, got 0"),
    (["bench", "A", "--kv-pool-fraction", "nan"], "argument --kv-pool-fraction: not a finite number: 'nan'"),
    (["bench", "--server", "http://127.0.0.1:9", "--rate", "0"], "argument --rate: must be > 0.0, got 0"),
    (["bench", "A", "--lora-mix", "-1"], "argument --lora-mix: must be >= 0, got -1"),
    (["eval", "A", "--perplexity", "prose", "--max-text-tokens", "0"], "argument --max-text-tokens: must be >= 1"),
    (["serve", "A", "--port", "65536"], "argument --port: a port is 0 to 65535, got 65536"),
])
def test_numbers_out_of_range_are_refused_by_the_parser(args, message):
    result = run_cli(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_diff_applier_follows_unified_diff_semantics():
    """The helper above, against a diff written out by hand (an insertion at the top, a change, a removal)."""
    before = ["a\n", "b\n", "c\n", "d\n", "e\n", "f\n", "g\n", "h\n", "i\n"]
    hunks = ["@@ -0,0 +1 @@\n", "+top\n", "@@ -4,6 +5,5 @@\n", " d\n", "-e\n", "+E\n", " f\n", "-g\n",
             " h\n", " i\n"]
    assert apply_unified_diff(before, hunks) == ["top\n", "a\n", "b\n", "c\n", "d\n", "E\n", "f\n", "h\n",
                                                 "i\n"]
    with pytest.raises(AssertionError, match="does not match"):
        apply_unified_diff(before, ["@@ -1,2 +1,2 @@\n", " x\n", " b\n"])


# ---- compile, dumps, the graph, inspect (the bundled model) ----

def test_compile_writes_one_dump_per_pass_in_pipeline_order(smollm2_fp32_compile):
    run = smollm2_fp32_compile
    assert f"compiled smollm2-135m -> {run.artifact}" in run.result.stdout
    manifest = json.loads((run.artifact / "manifest.json").read_text())
    pipeline = [info.name for info in resolve_pipeline("default")]
    assert [record["name"] for record in manifest["passes"]] == pipeline
    assert [record["index"] for record in manifest["passes"]] == list(range(1, len(pipeline) + 1))
    stems = ["00-traced"] + [f"{index:02d}-{name}" for index, name in enumerate(pipeline, 1)]
    expected = {f"{stems[0]}.txt", f"{stems[0]}.json"}
    expected |= {f"{stem}.{suffix}" for stem in stems[1:] for suffix in ("txt", "json", "diff")}
    assert {file.name for file in run.dump_dir.iterdir() if file.is_file()} == expected
    # Besides the pass dumps, only the generated kernel sources (docs/architecture.md, "Code generation") may be there.
    assert {file.name for file in run.dump_dir.iterdir() if not file.is_file()} <= {"kernels"}
    applied = 0
    for previous, stem, record in zip(stems[:-1], stems[1:], manifest["passes"], strict=True):
        summary = json.loads((run.dump_dir / f"{stem}.json").read_text())
        assert summary["name"] == record["name"] and summary["stats"] == record["stats"]
        assert summary["node_count"] == record["nodes_after"]
        before = (run.dump_dir / f"{previous}.txt").read_text().splitlines(keepends=True)
        after = (run.dump_dir / f"{stem}.txt").read_text().splitlines(keepends=True)
        diff = (run.dump_dir / f"{stem}.diff").read_text().splitlines(keepends=True)
        if before == after:  # fuse_pointwise finds nothing left after the pattern passes
            assert diff == [] and record["nodes_before"] == record["nodes_after"], stem
            continue
        assert diff[:2] == [f"--- {previous}\n", f"+++ {stem}\n"]
        assert apply_unified_diff(before, diff[2:]) == after, f"{stem}.diff does not turn {previous} into {stem}"
        applied += 1
    # fuse_pointwise and match_moe (SmolLM2 has no experts) leave the bundled model as they find it.
    assert applied >= len(pipeline) - 2, "every pass but fuse_pointwise and match_moe rewrites the bundled model"
    attention = json.loads((run.dump_dir / "02-match_attention.json").read_text())
    assert attention["name"] == "match_attention" and attention["stats"]["replaced_sdpa"] == 30
    assert json.loads((run.dump_dir / f"{stems[-1]}.json").read_text())["node_count"] == manifest["node_count"]


def test_graph_onnx_passes_the_full_onnx_checker(smollm2_fp32_artifact):
    onnx.checker.check_model(str(smollm2_fp32_artifact / "graph.onnx"), full_check=True)
    model = onnx.load(str(smollm2_fp32_artifact / "graph.onnx"), load_external_data=False)
    paged = [node for node in model.graph.node if (node.domain, node.op_type) == ("ai.octavo", "paged_attention")]
    assert len(paged) == 30


def test_inspect_shows_paged_attention_and_no_sdpa(smollm2_fp32_artifact):
    result = run_cli("inspect", str(smollm2_fp32_artifact), "--all-ops")
    assert result.returncode == 0, result.stderr
    assert "scaled_dot_product_attention" not in result.stdout
    counts = re.findall(r"octavo\.paged_attention\s*\S\s*(\d+)", result.stdout)
    assert counts == ["30"], result.stdout
    assert "smollm2-135m (llama, bundled)" in result.stdout
    assert "kv cache 30 layers x 3 kv heads x 64 dims, block 16, float32" in result.stdout
    assert "match_attention" in result.stdout and "replaced_sdpa=30" in result.stdout


def test_generate_chat_answers_as_hugging_face_does_with_the_real_model(smollm2_fp32_artifact, smollm2_source,
                                                                         smollm2_hf_fp32):
    """The printed answer is Hugging Face's greedy answer on the same weights, token for token: a float32
    artifact is token-exact with HF float32 (tests/test_smollm2.py), so no near-tie margin applies."""
    question = "What is the capital of France?"
    result = run_cli("generate", str(smollm2_fp32_artifact), "--prompt", question, "--chat", "--max-tokens", "12",
                     "--num-kv-blocks", "64", "--threads", "2")
    assert result.returncode == 0, result.stderr
    tokenizer = smollm2_source.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = smollm2_hf_fp32.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=12,
                                             do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert result.stdout == tokenizer.decode(generated, skip_special_tokens=True) + "\n", (result.stdout, generated)
    eos = smollm2_hf_fp32.generation_config.eos_token_id
    finish = "stop" if generated[-1] in (eos if isinstance(eos, list) else [eos]) else "length"
    assert f"({len(generated)} tokens in " in result.stderr and f"finish: {finish})" in result.stderr, result.stderr


# ---- generate on a tiny model: the printed text is what the API generates ----

@pytest.fixture(scope="module")
def tiny_llm(tiny_artifact):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(tiny_artifact("llama"), num_kv_blocks=16)
    torch.set_num_threads(previous)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_generate_prints_the_greedy_text(tiny_artifact, tiny_llm, chat):
    prompt = tiny_llm.apply_chat_template([{"role": "user", "content": TINY_PROMPT}]) if chat else TINY_PROMPT
    expected = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    args = ["generate", str(tiny_artifact("llama")), "--prompt", TINY_PROMPT, "--max-tokens", "40",
            "--num-kv-blocks", "16", "--threads", "1"]
    result = run_cli(*args, *(["--chat"] if chat else []))
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"
    assert f"({len(expected.token_ids)} tokens in " in result.stderr
    assert f"tok/s, finish: {expected.finish_reason})" in result.stderr
    assert_pool_full(tiny_llm.engine)


def test_chat_keeps_the_conversation_and_survives_a_rejected_message(tiny_artifact, tiny_llm):
    too_long = " ".join(["word"] * 40)
    result = subprocess.run([sys.executable, "-m", "octavo.cli", "chat", str(tiny_artifact("llama")),
                             "--max-tokens", "5", "--max-model-len", "64", "--num-kv-blocks", "16", "--threads", "1"],
                            input=f"Hi\n{too_long}\nBye\n/clear\nBye\n/exit\nnever sent\n", capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: the prompt has"), result.stderr
    params = SamplingParams(temperature=0, max_tokens=5)
    first = tiny_llm.chat([{"role": "user", "content": "Hi"}], params)[0].outputs[0].text
    second = tiny_llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first},
                            {"role": "user", "content": "Bye"}], params)[0].outputs[0].text
    fresh = tiny_llm.chat([{"role": "user", "content": "Bye"}], params)[0].outputs[0].text  # after /clear
    assert first.strip() and second.strip() and first != second and fresh != second
    assert first in result.stdout and second in result.stdout
    # After /clear the last reply is the one to "Bye" alone, with no history before it.
    assert result.stdout.index(first) < result.stdout.index(second) < result.stdout.rindex(fresh)
    assert result.stdout.count("tokens in ") == 0 and result.stderr.count("tokens in ") == 3  # /exit sent nothing
    assert_pool_full(tiny_llm.engine)


# ---- bad input: one `error: ` line, non-zero exit, nothing written ----

@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, tiny_artifact, tiny_model_dir) -> dict[str, Path]:
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "empty").mkdir()
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=64, n_positions=16)).save_pretrained(
        root / "gpt2")
    corrupted = Path(shutil.copytree(tiny_artifact("llama"), root / "corrupted"))
    weights = corrupted / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    future = Path(shutil.copytree(tiny_artifact("llama"), root / "future"))
    manifest = json.loads((future / "manifest.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (future / "manifest.json").write_text(json.dumps(manifest))
    existing = Path(shutil.copytree(tiny_artifact("llama"), root / "existing"))
    return {"root": root, "missing": root / "missing", "empty": root / "empty", "gpt2": root / "gpt2",
            "corrupted": corrupted, "future": future, "existing": existing, "model": tiny_model_dir("llama")}


BAD_INPUT_CASES = {
    "compile-missing-path": (["compile", "{missing}", "-o", "{out}"], "error: no such file or directory: {missing}"),
    "compile-dir-without-model": (["compile", "{empty}", "-o", "{out}"], "error: {empty} holds no model"),
    "compile-unsupported-model-type": (["compile", "{gpt2}", "-o", "{out}"],
                                       "error: unsupported model_type 'gpt2': Octavo supports {supported}"),
    "compile-existing-output": (["compile", "{model}", "-o", "{existing}"],
                                "error: {existing} already exists; pass --overwrite to replace it"),
    "generate-corrupted-weights": (["generate", "{corrupted}", "--prompt", "hi"],
                                   "error: checksum mismatch for {corrupted}/weights.safetensors"),
    "generate-other-format-version": (["generate", "{future}", "--prompt", "hi"],
                                      "error: artifact {future} has format version {future_version}; "
                                      "this Octavo reads version {version}"),
    "inspect-other-format-version": (["inspect", "{future}"], "error: artifact {future} has format version"),
    "generate-missing-path": (["generate", "{missing}", "--prompt", "hi"], "error: no such file or directory"),
    "inspect-not-an-artifact": (["inspect", "{empty}"], "error: {empty} is not an Octavo artifact"),
    "generate-prompt-too-long": (["generate", "{existing}", "--prompt", "A [bold]long[/bold] prompt, longer than six",
                                  "--max-model-len", "6"], "error: the prompt has 14 tokens, but the model's "
                                                           "max_model_len is 6"),
}


def case_fields(bad_inputs: dict[str, Path], case: str) -> dict[str, str]:
    fields = {name: str(path) for name, path in bad_inputs.items()}
    fields.update(out=str(bad_inputs["root"] / f"out-{case}"), supported=", ".join(sorted(ARCHITECTURES)),
                  version=str(FORMAT_VERSION), future_version=str(FORMAT_VERSION + 1))
    return fields


@pytest.fixture(scope="module")
def bad_input_runs(bad_inputs) -> tuple[dict[str, subprocess.CompletedProcess], bool]:
    """Every bad-input command, run concurrently (each is mostly interpreter start-up), and whether
    the input directory was left exactly as it was."""
    before = snapshot(bad_inputs["root"])
    commands = {case: [arg.format(**case_fields(bad_inputs, case)) for arg in args]
                for case, (args, _) in BAD_INPUT_CASES.items()}
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {case: pool.submit(run_cli, *command) for case, command in commands.items()}
        results = {case: future.result() for case, future in futures.items()}
    return results, snapshot(bad_inputs["root"]) == before


@pytest.mark.parametrize("case", list(BAD_INPUT_CASES))
def test_bad_input_is_one_error_line_and_writes_nothing(bad_inputs, bad_input_runs, case):
    results, inputs_unchanged = bad_input_runs
    result = results[case]
    fields = case_fields(bad_inputs, case)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line, got:\n{result.stderr}"
    assert lines[0].startswith(BAD_INPUT_CASES[case][1].format(**fields)), lines[0]
    assert result.stdout == ""
    assert not Path(fields["out"]).exists()
    assert inputs_unchanged, "a failed command wrote or changed files"
