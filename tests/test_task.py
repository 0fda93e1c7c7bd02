"""The synthetic task: verifier on hand-written cases, generator determinism, the heavy tail, JSONL export."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from tlt.task import MAX_STEPS, Problem, extract_answer, format_prompt, generate_problems, make_problem, verify
from tlt.task.problems import sample_steps, step_probabilities


def test_make_problem_hand_computed():
    p = make_problem(2, [("+", 7), ("*", 3), ("-", 5)])
    assert p == Problem(
        prompt="Compute mod 10: 2 +7 *3 -5", answer="2", steps=3, solution="2+7=9\n9*3=7\n7-5=2\nanswer: 2"
    )
    assert make_problem(3, [("-", 8)]).answer == "5"  # 3 - 8 = -5 = 5 (mod 10)
    assert make_problem(7, [("*", 9)]).solution == "7*9=3\nanswer: 3"
    with pytest.raises(ValueError):
        make_problem(1, [])


def test_format_prompt_is_chatml():
    p = make_problem(1, [("+", 1)])
    assert format_prompt(p) == "<|im_start|>user\nCompute mod 10: 1 +1<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("2+7=9\n9*3=7\n7-5=2\nanswer: 2", "2", True),
        ("answer: 2", "2", True),
        ("answer:2", "2", True),
        ("answer: 02", "2", True),  # zero padding only
        ("answer: 2<|im_end|>", "2", True),
        ("answer: 2\n", "2", True),
        ("answer: 2.", "2", True),
        ("answer: 3", "2", False),  # wrong
        ("answer: 12", "2", False),  # wrong, and not a prefix match
        ("answer: 1 answer: 2", "2", True),  # the last marker counts
        ("answer: 2\nanswer: 3", "2", False),
        ("answer: 2 but I am unsure", "2", True),  # extra text after the number
        ("I think answer: 2", "2", True),  # extra text before
        ("2+7=9", "9", False),  # malformed: no marker
        ("answer:", "2", False),  # malformed: nothing after the marker
        ("answer: two", "2", False),
        ("answer: 2x", "2", False),  # the number runs into other text
        ("answer: 2.5", "2", False),  # a decimal is not its integer part
        ("answer: 2,000", "2", False),
        ("answer: 2, then", "2", True),
        ("answer: 2 2", "2", True),
        ("", "2", False),
        ("Answer: 2", "2", False),  # the marker is exact, case included
    ],
)
def test_verify(completion, answer, expected):
    assert verify(completion, answer) is expected


def test_extract_answer():
    assert extract_answer("x\nanswer: 7") == "7"
    assert extract_answer("answer: -3") == "-3"
    assert extract_answer("no marker") is None
    assert extract_answer("answer: 1\nanswer: oops") is None  # the last marker is malformed


def test_reference_solutions_verify():
    for p in generate_problems(300, seed=5):
        assert verify(p.solution, p.answer)
        assert p.solution.count("\n") == p.steps
        assert 1 <= p.steps <= MAX_STEPS


def test_generator_deterministic_by_seed():
    a, b, c = generate_problems(50, seed=1), generate_problems(50, seed=1), generate_problems(50, seed=2)
    assert a == b
    assert a != c
    assert generate_problems(20, seed=1) == a[:20]  # a prefix of a longer draw


def test_step_distribution_is_heavy_tailed():
    probs = step_probabilities()
    assert len(probs) == MAX_STEPS
    assert sum(probs) == pytest.approx(1.0)
    assert all(x > y for x, y in zip(probs, probs[1:]))  # strictly decreasing
    rng = random.Random(0)
    steps = sorted(sample_steps(rng) for _ in range(20000))
    p50, p99 = steps[len(steps) // 2], steps[int(len(steps) * 0.99)]
    assert p50 <= 3
    assert p99 >= 24
    assert p99 / p50 >= 8
    # The empirical frequency of k=1 matches the law (zipf 1.5 truncated at 32: ~0.41).
    assert steps.count(1) / len(steps) == pytest.approx(probs[0], abs=0.015)


def test_solution_length_tail():
    lens = [len(p.solution) for p in generate_problems(4000, seed=3)]
    lens.sort()
    assert lens[int(len(lens) * 0.99)] / statistics.median(lens) >= 6


def test_export_jsonl(tmp_path):
    from tlt.cli import main

    out = tmp_path / "new" / "task.jsonl"  # its folder is created
    assert main(["task", "export", "--n", "25", "--seed", "4", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    problems = generate_problems(25, seed=4)
    assert len(rows) == 25
    for row, p in zip(rows, problems):
        assert row == {"prompt": format_prompt(p), "question": p.prompt, "answer": p.answer, "steps": p.steps}


@pytest.mark.parametrize("digit", ["\u0663", "\uff13", "\u09e9"])  # Arabic-Indic, full-width, Bengali three
def test_verify_accepts_ascii_digits_only(digit):
    # `\d` also matches other scripts' digits and int() parses them: "answer: ٣" must not score as 3.
    assert extract_answer(f"answer: {digit}") is None
    assert not verify(f"answer: {digit}", "3")
    assert not verify(f"answer: {digit}<|im_end|>", "3")


def test_answers_match_an_independent_left_to_right_evaluation():
    for seed in range(6):
        for p in generate_problems(300, seed=seed):
            start, *ops = p.prompt.removeprefix("Compute mod 10: ").split(" ")
            value = int(start)
            for op in ops:
                b = int(op[1:])
                value = {"+": value + b, "-": value - b + 10, "*": value * b}[op[0]] % 10
            assert p.answer == str(value), p


def test_sentence_punctuation_after_the_answer_and_the_reward_server_reads_it_the_same():
    """The docstring promised sentence punctuation after the number; `?` and `:` were refused, while the reward
    server's math verifier (the trainer's default reward) took them: a completion scored 1 in training and 0 in
    `tlt model eval`. For a bare integer answer (no \boxed{}, which the math verifier reads first) the two now give
    the same verdict wherever this module reads a number."""
    from tlt.services.reward.verifiers import math_verifier

    assert extract_answer("so the answer: 9?") == "9" and extract_answer("answer: 9: done") == "9"
    assert extract_answer("answer: 9:30") is None  # a time, not the number 9
    cases = ["answer: 9?", "answer: 9:", "answer: 9)x", "answer: 9,x", "answer: 9.x", "answer: 9.5", "answer: 9",
             "(answer: 9)", "answer: 09!", "answer: 9x", "answer: -9.", "answer: 9<|im_end|>", "answer: 9:30"]
    for completion in cases:
        for reference in ("9", "-9"):
            if extract_answer(completion) is not None:
                assert math_verifier("", completion, reference) == verify(completion, reference), (completion, reference)


def test_the_generator_draws_every_start_operation_and_operand_the_task_defines():
    """A generator that never started from 9, never multiplied, drew `*1` (an identity step) or `+0`, or ignored
    max_steps passed every other test: the answers stayed right for what was drawn. 3000 problems (~7,000
    operations) draw each of the 10 starts, 3 operations and their operands many times over."""
    problems = generate_problems(3000, seed=9)
    starts, operands = set(), {"+": set(), "-": set(), "*": set()}
    for p in problems:
        start, *ops = p.prompt.removeprefix("Compute mod 10: ").split(" ")
        starts.add(int(start))
        for op in ops:
            operands[op[0]].add(int(op[1:]))
    assert starts == set(range(10))
    assert operands == {"+": set(range(1, 10)), "-": set(range(1, 10)), "*": set(range(2, 10))}
    short = generate_problems(300, seed=9, max_steps=3)
    assert {p.steps for p in short} == {1, 2, 3}


def test_export_to_stdout(tmp_path, monkeypatch, capsys):
    """`--out -` writes the JSONL to stdout (for a pipe), not to a file named '-'."""
    from tlt.cli import main

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["task", "export", "--n", "3", "--seed", "4", "--out", "-"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["question"] for row in rows] == [p.prompt for p in generate_problems(3, seed=4)]
    assert list(tmp_path.iterdir()) == []
