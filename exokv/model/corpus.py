"""The builtin models' tokenizer corpus: fixed prose and sentences built in a fixed order.

The builtin tokenizer is trained on it (exokv.model.builtin), so changing a line
changes every builtin's token ids: bump builtin.GENERATOR_VERSION with it.
"""

from __future__ import annotations

_PROSE = """\
The morning was cold, and the river moved slowly under a thin layer of fog.
A farmer walked along the bank with two dogs, counting the boats that passed.
She had lived in the valley for forty years and knew every bend of the water.
When the sun finally rose above the hills, the fog lifted and the fields turned gold.
In the city, people hurried to work, carrying coffee and checking their phones.
The train was late again, so a teacher read a book about the history of maps.
Old maps were drawn by hand, and many of them showed islands that never existed.
Sailors believed those islands were real because the maps said so.
Today we trust satellites, but a map is still a story about a place.
A computer stores numbers in memory, and a program tells it what to do with them.
Memory is fast but small; a disk is large but slow; a good program uses both well.
When two computers work together, they must agree on what each one has seen.
If one machine forgets something that the other remembers, the answer breaks.
That is why careful engineers write down every decision and share it with every node.
The kitchen smelled of bread, onions and fresh basil from the garden.
To make a simple soup, cut the vegetables, warm some oil, and cook them gently.
Add water or stock, a pinch of salt, and let it simmer for half an hour.
Taste it before serving, because every pot of soup is a little different.
The children asked why the sky is blue, and their grandfather smiled.
Light from the sun is scattered by the air, and blue light scatters the most.
At sunset the light travels through more air, so we see red and orange instead.
A good question is often more valuable than a quick answer.
The library opened at nine, and the first visitor wanted a book about stars.
Stars are huge balls of hot gas, and some of them are older than the earth.
Our sun is an ordinary star, neither the largest nor the smallest.
The astronomer pointed the telescope at a faint cloud and waited patiently.
Music filled the hall as the orchestra began to play a quiet piece.
The violins carried the melody while the drums kept a steady rhythm.
After the concert, everyone walked home through the quiet streets.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Can you help me plan a trip? Of course. Where would you like to go, and for how long?
Please explain how a cache works. A cache keeps recent results so they can be reused.
Why is my program slow? It may be doing the same work again and again.
What is the capital of France? The capital of France is Paris.
Write a short poem about the sea. The sea is wide, the sea is deep,
it sings the sailors off to sleep.
Tell me a story. Once upon a time, a small robot learned to paint the morning sky.
Thank you for your help! You are welcome. Have a wonderful day.
"""

_SUBJECTS = (
    "the engineer",
    "a young student",
    "my neighbor",
    "the old captain",
    "our team",
    "the robot",
    "a curious child",
    "the doctor",
    "every musician",
    "the gardener",
)
_VERBS = (
    "builds",
    "remembers",
    "explains",
    "finds",
    "repairs",
    "draws",
    "measures",
    "describes",
    "forgets",
    "shares",
)
_OBJECTS = (
    "a wooden bridge",
    "the long answer",
    "three small boxes",
    "the red apple",
    "a quiet song",
    "the broken clock",
    "an ancient map",
    "the weather report",
    "a secret garden",
    "the first message",
)
_PLACES = (
    "in the morning",
    "near the station",
    "after dinner",
    "on a rainy day",
    "by the window",
    "during the meeting",
    "under the bridge",
    "at the market",
)


def corpus_lines() -> list[str]:
    """The tokenizer's training text: fixed prose plus sentences built in a fixed order."""
    lines = [line for line in _PROSE.splitlines() if line.strip()]
    n_s, n_v, n_o, n_p = len(_SUBJECTS), len(_VERBS), len(_OBJECTS), len(_PLACES)
    for i in range(2000):
        # Fixed strides instead of a random generator, whose stream may change between
        # Python versions and would change the tokenizer with it.
        s = _SUBJECTS[i % n_s]
        v = _VERBS[(i * 3 + i // n_s) % n_v]
        o = _OBJECTS[(i * 7 + i // (n_s * n_v)) % n_o]
        p = _PLACES[(i * 5) % n_p]
        sentence = f"{s} {v} {o} {p}"
        capital = sentence[0].upper() + sentence[1:]
        if i % 4 == 0:
            lines.append(f"Why does {s} {v.rstrip('s')} {o}? Because it matters {p}.")
        elif i % 4 == 1:
            lines.append(f"{capital}, and {i % 97} people watch.")
        elif i % 4 == 2:
            lines.append(f'"{capital}," she said at {i % 12 + 1}:{i % 60:02d}.')
        else:
            lines.append(f"- Item {i}: {o} ({p}) = {i * 13 % 1000} / {i % 7 + 2}; done.")
    lines.extend(lines[: len(_PROSE.splitlines())] * 3)
    return lines
