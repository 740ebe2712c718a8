"""A small embedded English corpus for training the byte-level BPE tokenizer that
`tandem make-model` ships with its random checkpoints.

Nothing can be downloaded where tests run, so the text lives here. It is varied on purpose
(prose, dialogue, code, numbers, punctuation) so the merges it yields make ordinary prompts
tokenize into a sensible number of tokens. `synthetic_words` tops the corpus up with
deterministic pseudo-words so a BPE of any preset's vocabulary size can be filled.
"""

from __future__ import annotations

import random

ENGLISH_TEXT = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.

Once upon a time, in a small village by the sea, there lived an old fisherman and his
daughter. Every morning they walked down to the harbour before the sun came up, and every
evening they came back with a basket of silver fish. The neighbours said the girl could
read the weather in the colour of the water, and that she had never once been caught by a
storm. When the traveller asked her how she did it, she laughed and said that she simply
paid attention: the gulls fly low, the wind turns to the east, and the waves grow short.

Large language models predict the next token given the tokens that came before. A model is
trained on a great deal of text, and at inference time it reads a prompt, builds a cache of
keys and values for every layer, and then produces one token at a time. Serving such a model
well is a scheduling problem as much as a numerical one: prefill is bound by compute, while
decode is bound by memory bandwidth. Splitting the two lets each pool be sized for its own
bottleneck, at the cost of moving the key-value cache from one machine to another.

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: And how many people live there?
Assistant: About two million people live in the city itself, and more than twelve million in
the wider metropolitan area.
User: Can you write me a short poem about autumn?
Assistant: Leaves of amber, leaves of rust, / drifting down in golden dust; / the year exhales
a cooler breath, / and dreams of spring beneath the frost.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]

for i in range(10):
    print(f"step {i}: value = {i * i}")

class Request:
    def __init__(self, request_id, prompt, max_tokens=16):
        self.request_id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens

SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name;
{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}

Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 2048 4096 65536 3.14159
2.71828 1,000,000 -42 +7 50% 99.9% $19.99 12:30 PM, March 3rd, 2025; 1st 2nd 3rd 4th 5th.

The history of science is full of surprises. Early astronomers believed the stars were
fixed to a crystal sphere; later, careful measurements showed that the planets moved in
ellipses around the sun. Chemistry grew out of alchemy, medicine out of folk remedies, and
computing out of the looms that wove patterned silk. Each step began with someone who
looked closely at a thing everyone else took for granted and asked a simple question: why?

Recipe for a simple bread: mix five hundred grams of flour, ten grams of salt, seven grams
of yeast and three hundred and fifty millilitres of warm water. Knead for ten minutes,
let it rise for an hour, shape it into a loaf, let it rise again, and bake it at two hundred
and twenty degrees for about thirty-five minutes, until the crust is brown and it sounds
hollow when you tap the bottom.

Weather report: cloudy in the morning with a chance of light rain, clearing in the
afternoon. Highs near eighteen degrees, lows around nine. Winds from the north-west at
fifteen kilometres per hour. Tomorrow will be sunny and warmer.

"Where are you going?" asked the rabbit.
"To the top of the hill," said the tortoise, "to see what is on the other side."
"But that will take you all day!"
"Then I had better start now," said the tortoise, and he did.

A good engineer writes code that other people can read. Names should say what a thing is;
functions should do one thing; errors should tell the reader what went wrong and what to do
about it. Tests describe behaviour, not implementation, and they should fail when the
behaviour breaks. Small, well-named pieces compose into systems that are easy to change.

Mountains, rivers, forests, deserts, oceans, islands, valleys, glaciers, volcanoes, plains.
Red, orange, yellow, green, blue, indigo, violet, black, white, grey, brown, pink, purple.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, April,
May, June, July, August, September, October, November, December. Spring, summer, winter.
Apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum, strawberry, melon.
I am, you are, he is, she is, it is, we are, they are; I was, you were, they have been.
Can't, won't, don't, isn't, aren't, wasn't, weren't, shouldn't, couldn't, wouldn't, it's.
Questions? Answers! Ideas; lists: (one) [two] {three} <four> 'single' "double" `code` --
hyphen-ated words, under_scored_names, CamelCaseNames, UPPER CASE, lower case, Title Case.
"""

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def synthetic_words(count: int, seed: int = 0) -> list[str]:
    """Deterministic pseudo-words (2-4 consonant-vowel syllables, some capitalised).

    English text of a few KB runs out of byte pairs to merge well before a vocabulary of
    thousands is full; these words give the trainer enough distinct pairs to fill any preset.
    """
    rng = random.Random(seed)
    words = []
    for _ in range(count):
        syllables = rng.randint(2, 4)
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        if rng.random() < 0.2:
            word = word.capitalize()
        words.append(word)
    return words
