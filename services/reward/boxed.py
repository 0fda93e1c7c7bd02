r"""`\boxed{...}` answer extraction and normalisation for general math answers.

    last_boxed(r"so \boxed{\frac{1}{2}}.")  -> r"\frac{1}{2}"
    normalize(r"\dfrac{1}{2}")              -> r"\frac{1}{2}"
    equivalent("0.5", r"\frac{1}{2}")       -> True

Extraction takes the LAST `\boxed` (or `\fbox`) in the text and its balanced
brace group, so nested braces (`\boxed{\frac{a}{b}}`) are kept whole and
escaped braces (`\{`, `\}`) do not count; `\boxed 5` (no braces) takes the
next token. An unclosed group means no answer. With several boxed answers
only the last counts (MATH's `last_boxed_only_string` rule): `\boxed{2}` and
`\boxed{3}` is the answer 3.

Normalisation is deliberately conservative: it removes presentation (spaces,
`$`, `\left`/`\right` (not `\leftarrow`; `\left.` with its empty delimiter), spacing commands, `\text{}` wrappers, degree and
percent signs, braces around the whole answer or after one sign (`{5}`: `\boxed{{5}}` is 5, `\boxed{-{5}}` is -5), a leading `x =` (compared apart: `y=5` is not `x=5`, see `equivalent`), a leading `+`, thousands separators `1,000` (not `2, 300`: a comma and a
space make a list) and LaTeX's `1{,}000`, a trailing period, units: a `\text{ cm}` or `\mbox{ cm}` of words
after a plain number, optionally squared or cubed (not a hedge: `12\text{ or thirteen}`), as math-verify and MATH's
`strip_string` drop them) and rewrites `\dfrac`/`\tfrac` to `\frac`, a U+2212 minus to `-`. A
percent sign is dropped, not divided out: `50\%` equals 50, not 0.5. Two
answers are equivalent when their normal forms are equal, or when both are
plain numbers (integers, decimals, `a/b`, `\frac{a}{b}`) with exactly the same
rational value. It does not do symbolic algebra: `2x+2` and `2(x+1)` are
different answers here. Letters are compared without case (`\text{Yes}` is
`yes`, a choice `(A)` is `(a)`), command names with it: `\Delta` is not
`\delta`. A degree sign is only `^\circ` / `^{\circ}`: a bare `\circ` is
function composition and stays.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = (r"\boxed", r"\fbox")


def _group_end(text: str, open_idx: int) -> int | None:
    """Index just past the brace group opening at `open_idx`, or None if it never closes."""
    depth = 0
    i = open_idx
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # skip the escaped character (\{ \} \\)
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` / `\fbox{...}` / `\boxed x` in `text`, or None."""
    starts = [(text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS]
    idx, cmd = max(starts)
    if idx < 0:
        return None
    rest = idx + len(cmd)
    j = rest
    while j < len(text) and text[j].isspace():  # TeX skips any white space after a command word
        j += 1
    if j < len(text) and text[j] == "{":
        end = _group_end(text, j)
        return None if end is None else text[j + 1 : end - 1]
    if j == rest and text[j : j + 1].isalpha():  # `\boxedfoo`: another command, not a box (`\boxed2` is a box:
        return None                            # a TeX command word ends at the first non-letter)
    m = re.match(r"[^\s$]+", text[j:])
    return m.group(0).rstrip(".") if m else None


def _unwrap(text: str, command: str) -> str:
    r"""Replace every `\command{X}` by `X` (balanced braces)."""
    out = []
    i = 0
    while (k := text.find(command + "{", i)) >= 0:
        end = _group_end(text, k + len(command))
        if end is None:
            break
        out.append(text[i:k])
        out.append(text[k + len(command) + 1 : end - 1])
        i = end
    out.append(text[i:])
    return "".join(out)


_REMOVE = (r"\!", r"\,", r"\;", r"\:", r"\ ", "^{\\circ}", "^\\circ", r"\%", "%", r"\$", "$")
# whole command words only: `\leftarrow` is not `\left` + `arrow`
_REMOVE_WORDS = re.compile(r"\\(?:left|right)(?![A-Za-z])(?:\s*\.)?|\\displaystyle(?![A-Za-z])")  # `\left.`: no delimiter
_COMMAND_WORD = re.compile(r"\\[A-Za-z]+")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$", re.ASCII)
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_LHS = re.compile(r"^[a-zA-Z](_\{?\w+\}?)?=(?!=)")


_UNIT_COMMANDS = (r"\text", r"\mbox")  # not \mathrm: `2\mathrm{i}` is a number, not 2 of a unit
# Linear-time patterns only: `[..]*[A-Za-z][..]*` and three `\s*` in a row backtracked (seconds to minutes on a
# long run of spaces, as degenerate RL outputs have), holding a reward worker per item.
_UNIT_WORDS = re.compile(r"[A-Za-z .~]+", re.ASCII)  # and at least one letter (`_unit_words`)
_UNIT_TAIL = re.compile(r"(\^\{?[23]\}?)?\s*\.?")  # after strip(): cm^2, m^{3}, a sentence's period


# words that make `\text{...}` after a number a hedge or a second answer, not a unit: `12\text{ or thirteen}`
_NOT_UNIT_WORDS = frozenset({"or", "and", "to", "than", "more", "less", "at", "least", "most", "about", "approx",
                             "approximately", "around", "nearly", "almost", "not", "between", "plus", "minus"})


def _unit_words(s: str) -> bool:
    return (_UNIT_WORDS.fullmatch(s) is not None and any(c.isalpha() for c in s)
            and not _NOT_UNIT_WORDS.intersection(s.lower().replace("~", " ").replace(".", " ").split()))


def _without_units(s: str) -> str:
    r"""`s` without a unit after a plain number (`12\text{ cm}` -> `12`), else `s` as it is.

    Unwrapping the `\text{}` instead made `12cm`, which never equals the reference 12. Only words after
    something that normalises to a plain number, with nothing but a power or a period after them, are a
    unit: `5\text{ or }6` and `x\text{ cm}` are kept whole.
    """
    for cmd in _UNIT_COMMANDS:
        k = s.find(cmd + "{")
        if k <= 0:
            continue
        end = _group_end(s, k + len(cmd))
        if (end is not None and _unit_words(s[k + len(cmd) + 1 : end - 1])
                and _UNIT_TAIL.fullmatch(s[end:].strip()) and as_number(normalize(s[:k])) is not None):
            return s[:k]
    return s


def normalize(answer: str) -> str:
    """A canonical string for an answer (see the module docstring for what is removed)."""
    return _normal_parts(answer)[1]


def _normal_parts(answer: str) -> tuple[str, str]:
    """(the leading `x =`'s variable or "", the canonical rest): `normalize` is the rest."""
    s = _without_units(answer.strip().replace("\u2212", "-"))  # U+2212, the typeset minus sign
    for cmd in (r"\text", r"\textbf", r"\mathrm", r"\mathbf", r"\mbox", r"\boxed"):
        s = _unwrap(s, cmd)
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    s = _REMOVE_WORDS.sub("", s)
    for token in _REMOVE:
        s = s.replace(token, "")
    listed = re.search(r",\s", s) is not None  # `2, 300`: two answers, never the number 2300
    s = _without_outer_braces("".join(s.split()))  # `{x=5}`: the `x =` is seen below
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    lhs = ""
    if m := _LHS.match(s):
        lhs, s = m.group(0)[:-1].replace("{", "").replace("}", ""), s[m.end():]  # x_{1} is x_1
    s = _without_outer_braces(s.rstrip("."))
    # one sign before braced digits: `-{5}` typesets as -5 and `+{5}` as 5, so the braces come off after the sign
    # too (before the separators: `+1,000` is 1000); `+-7` and `+{-5}` are no one sign (tlt.task's verifier
    # reads no number in `+-7`) and stay as written
    if s[:1] in ("+", "-") and not (body := _without_outer_braces(s[1:])).startswith(("+", "-")):
        s = body if s[0] == "+" else "-" + body
    if not listed and _THOUSANDS.match(s.replace("{,}", ",")):  # `1{,}000`: LaTeX's thousands separator
        s = s.replace("{,}", "").replace(",", "")
    return lhs.lower(), _lower_but_commands(s)


def _without_outer_braces(s: str) -> str:
    r"""`s` without brace groups around the whole of it: `{5}` and `{{\frac{1}{2}}}` typeset as `5` and `\frac{1}{2}`
    (a model's `\boxed{{5}}` is the answer 5). An escaped `\{5\}` (a set), `{1}/{2}` and an empty `{}` stay as they
    are. One pass over `s` (peeling group by group rescanned it: 23 s for 16,000 nested braces)."""
    if not s.startswith("{"):
        return s
    partner, open_at, i = {}, [], 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2  # an escaped character (\{ \} \\)
            continue
        if c == "{":
            open_at.append(i)
        elif c == "}" and open_at:
            partner[open_at.pop()] = i
        i += 1
    k = 0
    while s[k : k + 1] == "{" and partner.get(k) == len(s) - 1 - k and len(s) - 2 * k > 2:
        k += 1
    return s[k : len(s) - k]


def _lower_but_commands(s: str) -> str:
    r"""`s` in lower case except its command words: `\Delta` stays apart from `\delta`, `\text{Yes}` -> yes."""
    out, i = [], 0
    for m in _COMMAND_WORD.finditer(s):
        out += [s[i : m.start()].lower(), m.group(0)]
        i = m.end()
    out.append(s[i:].lower())
    return "".join(out)


# re.ASCII: numbers are written in ASCII digits (\d would take other scripts' digits, which int() and
# Fraction() parse, so `\boxed{٧}` scored as 7)
_NUMBER = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)$", re.ASCII)
_SLASH = re.compile(r"^(-?\d+)/(-?\d+)$", re.ASCII)
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$", re.ASCII)


def as_number(normal: str) -> Fraction | None:
    """The exact rational value of a normalised plain number, or None if it is not one."""
    try:
        if _NUMBER.match(normal):
            return Fraction(normal)
        if m := _SLASH.match(normal):
            return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) else None
        if m := _FRAC.match(normal):
            value = Fraction(int(m.group(2)), int(m.group(3))) if int(m.group(3)) else None
            return -value if value is not None and m.group(1) else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


def equivalent(answer: str, reference: str) -> bool:
    """True when `answer` and `reference` normalise equal or are the same rational number.

    A leading `x =` is dropped only when the other answer has none (`x=5` equals 5); two equations must name the
    same variable (`y=5` is not `x=5`), as in math-verify. MATH's `strip_string` drops it on both sides, which
    rewards a wrong variable."""
    (lhs_a, a), (lhs_b, b) = _normal_parts(answer), _normal_parts(reference)
    if lhs_a and lhs_b and lhs_a != lhs_b:
        return False
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = as_number(a), as_number(b)
    return x is not None and y is not None and x == y
