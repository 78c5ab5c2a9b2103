"""A built-in short-answer task (``--dataset short_answer``): questions with one-word answers.

Easy facts a small instruct model mostly knows (capitals, opposites, sequences, colours,
arithmetic), so that accuracy separates a method that follows the target from one that
does not. Answers are checked by ``quality.check_answer`` (numbers numerically, words by
whole-word match after normalisation, so "Mars" is not found in "Earth" nor "Marsupial").
"""

from __future__ import annotations

from .prompt import Prompt

_CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Russia": "Moscow",
    "China": "Beijing",
    "Egypt": "Cairo",
    "England": "London",
    "Greece": "Athens",
    "Portugal": "Lisbon",
    "Austria": "Vienna",
    "Ireland": "Dublin",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Poland": "Warsaw",
    "Hungary": "Budapest",
    "Thailand": "Bangkok",
    "South Korea": "Seoul",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Argentina": "Buenos Aires",
    "Cuba": "Havana",
    "Mexico": "Mexico City",
    "Canada": "Ottawa",
    "Australia": "Canberra",
    "India": "New Delhi",
    "Turkey": "Ankara",
}
_OPPOSITES = {
    "hot": "cold",
    "up": "down",
    "big": "small",
    "fast": "slow",
    "day": "night",
    "open": "closed",
    "happy": "sad",
    "light": "dark",
    "old": "young",
    "wet": "dry",
    "early": "late",
    "full": "empty",
    "hard": "soft",
    "high": "low",
    "left": "right",
    "win": "lose",
    "rich": "poor",
    "push": "pull",
    "first": "last",
    "strong": "weak",
}
_COLOURS = {
    "the sky on a clear day": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a ripe banana": "yellow",
    "a ripe tomato": "red",
    "an orange": "orange",
    "milk": "white",
    "a lemon": "yellow",
    "blood": "red",
}
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
_FACTS = {
    "What is the largest planet in our solar system?": "Jupiter",
    "Which planet is known as the Red Planet?": "Mars",
    "What gas do plants absorb from the air for photosynthesis?": "carbon dioxide",
    "What is frozen water called?": "ice",
    "Which animal is known as the king of the jungle?": "lion",
    "How many legs does a spider have?": "8",
    "How many days are there in a week?": "7",
    "How many continents are there on Earth?": "7",
    "What is the largest ocean on Earth?": "Pacific",
    "Who wrote Romeo and Juliet?": "Shakespeare",
    "What is the chemical symbol for gold?": "Au",
    "What do bees make?": "honey",
    "What is the closest star to Earth?": "Sun",
    "What is the boiling point of water in degrees Celsius?": "100",
    "How many hours are there in a day?": "24",
    "What is the tallest animal in the world?": "giraffe",
    "Which language is spoken in Brazil?": "Portuguese",
    "What is the opposite of north?": "south",
    "What is the main language spoken in the United States?": "English",
    "Which organ pumps blood through the body?": "heart",
}


def short_answer_prompts() -> list[Prompt]:
    """The task: about 150 questions, each asking for a one-word (or one-number) answer."""
    items: list[tuple[str, str, str]] = []
    items += [("capitals", f"What is the capital of {c}?", a) for c, a in _CAPITALS.items()]
    items += [("opposites", f"What is the opposite of '{w}'?", a) for w, a in _OPPOSITES.items()]
    items += [("colours", f"What colour is {t}?", a) for t, a in _COLOURS.items()]
    items += [
        ("sequences", f"Which day of the week comes after {d}?", _DAYS[(i + 1) % 7])
        for i, d in enumerate(_DAYS)
    ]
    items += [
        ("sequences", f"Which month comes after {m}?", _MONTHS[(i + 1) % 12]) for i, m in enumerate(_MONTHS)
    ]
    items += [("arithmetic", f"What is {a} plus {b}?", str(a + b)) for a, b in _pairs(20, 3, 9)]
    items += [("arithmetic", f"What is {a} times {b}?", str(a * b)) for a, b in _pairs(15, 2, 6)]
    items += [("facts", q, a) for q, a in _FACTS.items()]
    suffix = " Answer with one word."
    return [
        Prompt(f"sa-{i:03d}", text + (" Answer with a number." if a.isdigit() else suffix), cat, a)
        for i, (cat, text, a) in enumerate(items)
    ]


def _pairs(count: int, low: int, span: int) -> list[tuple[int, int]]:
    """``count`` distinct operand pairs from [low, low + span), fixed (the task must never change)."""
    grid = [(a, b) for a in range(low, low + span) for b in range(low, low + span)]
    step = max(1, len(grid) // count)
    return grid[::step][:count]
