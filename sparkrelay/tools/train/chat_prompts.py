"""General chat prompts made from handwritten templates and topics: drafter training data for the
kinds of request the six prompt sets hold only a few of.

MT-Bench's training split is 64 prompts (writing, roleplay, reasoning, extraction, STEM,
humanities), and the SmolLM2 drafter accepts least there; these prompts give it the target's answers
to thousands more requests of those kinds. Every template and topic below was written for this
project (none is taken from an evaluation set), and `synthetic_prompts(n)` draws the same n prompts
on every run, so the answers file resumes like the others.
"""

from __future__ import annotations

import random

# (kind of topic, template); a template names its topic {t}
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("thing", "Write a short poem about {t}."),
    ("thing", "Write a product description for {t} that would make someone want to buy it."),
    ("thing", "Tell me five interesting facts about {t}."),
    ("thing", "Write a short story in which {t} plays an important part."),
    ("thing", "Describe {t} to someone who has never seen one."),
    ("concept", "Explain {t} in simple terms."),
    ("concept", "Explain {t} to a ten-year-old."),
    ("concept", "What are the most common misconceptions about {t}?"),
    ("concept", "Write a short quiz with three questions about {t}, and give the answers."),
    ("concept", "How would you teach {t} in a one-hour lesson? Give a plan."),
    ("event", "What were the main causes and consequences of {t}?"),
    ("event", "Write a diary entry by someone who lived through {t}."),
    ("event", "Summarize {t} in one paragraph."),
    ("goal", "How can I {t}?"),
    ("goal", "Give me a step-by-step plan to {t}."),
    ("goal", "What are the most common mistakes people make when they try to {t}?"),
    ("goal", "Write a motivational message for a friend who wants to {t}."),
    ("role", "Pretend you are {t}. Introduce yourself and describe a typical day."),
    ("role", "You are {t}. Give me your best advice for a beginner in your field."),
    ("role", "Write a job advertisement for {t}."),
    ("place", "Write a travel guide paragraph about {t}."),
    ("place", "Plan a three-day trip to {t}."),
    ("place", "What should a visitor know before going to {t}?"),
    ("debate", "What are the pros and cons of {t}?"),
    ("debate", "Write a persuasive essay arguing for {t}."),
    ("debate", "Give two arguments for and two against {t}, then state your own view."),
    ("task", "Write a Python function that {t}."),
    ("task", "Write a Python function that {t}, with a docstring and two example calls."),
    ("task", "Explain how you would write a program that {t}, then write it in Python."),
    ("message", "Write a polite email {t}."),
    ("message", "Write a short text message {t}."),
    ("thing", "Invent a riddle whose answer is {t}, and explain it."),
    ("concept", "Write a dialogue between a student and a teacher about {t}."),
    ("concept", "Give a real-world example of {t} and explain it."),
    ("event", "Imagine {t} had never happened. How might the world be different?"),
    ("goal", "My friend wants to {t} but has only thirty minutes a day. What do you suggest?"),
    ("role", "Write a short speech that {t} gives at a school career day."),
    ("place", "Write a postcard to a friend from {t}."),
    ("debate", "Write a short dialogue between two people who disagree about {t}."),
    ("task", "What is a clean way in Python to write a function that {t}? Explain the edge cases."),
)

# how the answer should look: none, or a constraint of the kind chat users add
STYLES: tuple[str, ...] = (
    "", "", " Keep it under 100 words.", " Use a bulleted list.", " Write it in a formal tone.",
    " Make it funny.", " Answer in exactly three sentences.", " Explain your reasoning.",
)

TOPICS: dict[str, tuple[str, ...]] = {
    "thing": (
        "a lighthouse", "an old bicycle", "a violin", "a pocket watch", "a kite", "a teapot",
        "a library card", "a telescope", "a snow globe", "a paper boat", "a houseplant",
        "a pair of running shoes", "a thermos", "a chessboard", "a backpack", "an umbrella",
        "a mechanical keyboard", "a sailboat", "a compass", "a lantern", "a sourdough loaf",
        "a honeybee", "an octopus", "a cactus", "a hot-air balloon", "a typewriter",
    ),
    "concept": (
        "photosynthesis", "gravity", "compound interest", "the water cycle", "natural selection",
        "supply and demand", "inflation", "black holes", "vaccines", "the greenhouse effect",
        "machine learning", "encryption", "plate tectonics", "the immune system", "probability",
        "electric circuits", "recursion", "democracy", "opportunity cost", "entropy",
        "the speed of light", "DNA", "sorting algorithms", "the stock market", "sound waves",
        "prime numbers", "the scientific method", "climate and weather", "friction", "taxes",
    ),
    "event": (
        "the invention of the printing press", "the first moon landing", "the Industrial Revolution",
        "the fall of the Roman Empire", "the Renaissance", "the invention of the telephone",
        "the building of the transcontinental railroad", "the discovery of penicillin",
        "the French Revolution", "the invention of the internet", "the Great Depression",
        "the age of sail", "the first powered flight", "the spread of the steam engine",
    ),
    "goal": (
        "learn a new language", "sleep better", "save money on groceries", "start running",
        "keep a houseplant alive", "write a novel", "get better at public speaking",
        "organize a small kitchen", "prepare for a job interview", "learn to play the guitar",
        "stop procrastinating", "cook healthy meals on a budget", "make new friends in a new city",
        "study for a math exam", "reduce screen time", "start a vegetable garden",
        "learn to program", "run a productive meeting", "train a puppy", "plan a wedding",
    ),
    "role": (
        "a pirate captain", "a detective in 1920s London", "a chef in a busy restaurant",
        "a museum tour guide", "an astronaut on the space station", "a medieval blacksmith",
        "a kindergarten teacher", "a park ranger", "a professional chess player", "a beekeeper",
        "a lighthouse keeper", "a software engineer", "a marine biologist", "a train conductor",
        "a librarian", "a mountain guide",
    ),
    "place": (
        "Paris", "Tokyo", "a small fishing village", "the Sahara desert", "Rome", "New York City",
        "the Swiss Alps", "Iceland", "a national park", "Cairo", "Kyoto", "Lisbon",
        "the Amazon rainforest", "Buenos Aires", "a tropical island", "Edinburgh",
    ),
    "debate": (
        "working from home", "school uniforms", "electric cars", "a four-day work week",
        "homework for young children", "social media for teenagers", "nuclear power",
        "living in a big city", "learning Latin at school", "space exploration", "online classes",
        "self-driving cars", "banning single-use plastics", "public transport being free",
    ),
    "task": (
        "reverses the words in a sentence", "counts the vowels in a string",
        "checks whether a number is a palindrome", "merges two sorted lists",
        "returns the n-th Fibonacci number", "finds the most common element in a list",
        "removes duplicates from a list while keeping the order",
        "converts a temperature from Celsius to Fahrenheit", "checks whether a string is an anagram of another",
        "flattens a nested list", "computes the greatest common divisor of two numbers",
        "returns all prime numbers below n", "groups words by their first letter",
        "finds the second largest number in a list", "checks whether brackets in a string are balanced",
        "counts how often each word appears in a text", "rotates a list by k positions",
        "converts a Roman numeral to an integer", "computes the sum of the digits of a number",
        "returns the longest word in a sentence", "transposes a matrix given as a list of lists",
        "checks whether a year is a leap year", "computes the median of a list of numbers",
        "splits a list into chunks of size n", "capitalizes the first letter of every word",
    ),
    "message": (
        "to a neighbour asking them to water your plants", "to a teacher asking for an extension",
        "declining a party invitation", "thanking a colleague for their help",
        "to a landlord about a broken heater", "inviting friends to a picnic",
        "apologizing for missing a meeting", "asking a manager for a day off",
        "congratulating a friend on a new job", "to a customer explaining a delayed order",
    ),
}


def all_prompts() -> list[tuple[str, str]]:
    """(kind, prompt) for every template with every topic of its kind, in a fixed order."""
    return [(kind, tpl.format(t=topic)) for kind, tpl in TEMPLATES for topic in TOPICS[kind]]


def synthetic_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct prompts (at most one per template and topic), each kind's shuffled by `seed` and
    the kinds taken in turn, each prompt given a style drawn from the same seed: the same list on
    every run, and any prefix mixes every kind."""
    rng = random.Random(seed)
    by_kind: dict[str, list[str]] = {}
    for kind, text in all_prompts():
        by_kind.setdefault(kind, []).append(text)
    for texts in by_kind.values():
        rng.shuffle(texts)
    longest = max(len(v) for v in by_kind.values())
    turns = [v[i] for i in range(longest) for v in by_kind.values() if i < len(v)]
    return [text + rng.choice(STYLES) for text in turns[:n]]
