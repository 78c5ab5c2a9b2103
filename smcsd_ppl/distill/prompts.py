"""A built-in, general-purpose prompt set for distillation (``--prompts builtin``).

Instruction templates crossed with everyday topics: varied requests (explain, list, compare,
write, advise) so the draft sees the target's chat register beyond any one benchmark.
"""

from __future__ import annotations

_TOPICS = """\
photosynthesis, the water cycle, volcanoes, earthquakes, black holes, the moon, the solar system,
climate change, recycling, electricity, magnets, gravity, the human heart, sleep, vaccines,
the immune system, healthy eating, running, yoga, chess, the piano, jazz, the guitar, painting,
photography, the Roman Empire, ancient Egypt, the printing press, the internet, smartphones,
artificial intelligence, computer programming, Python, databases, cryptography, bicycles,
electric cars, airplanes, trains, bridges, skyscrapers, coffee, tea, bread baking, chocolate,
rice, honey bees, dolphins, elephants, penguins, cats, dogs, forests, deserts, oceans, rivers,
mountains, rainbows, snow, hurricanes, saving money, budgeting, job interviews, public speaking,
learning a language, writing an essay, time management, friendship, teamwork, gardening,
houseplants, composting, camping, hiking, swimming, football, tennis, the Olympics, museums,
libraries, newspapers, email etiquette, online privacy, passwords, renewable energy, solar panels,
wind turbines, nuclear power, the stock market, inflation, taxes, supply and demand, maps,
compasses, clocks, calendars, prime numbers, fractions, percentages, triangles, probability,
statistics, democracy, elections, human rights, Shakespeare, poetry, fairy tales, dinosaurs,
fossils, DNA, evolution, bacteria, viruses, the brain, memory, habits, stress, kindness"""

_TEMPLATES = (
    "Explain {t} to a ten-year-old.",
    "What are three interesting facts about {t}?",
    "Write a short paragraph about {t}.",
    "What is the most common misconception about {t}?",
    "Give me some practical tips related to {t}.",
    "Write a haiku about {t}.",
    "Summarize the history of {t} in a few sentences.",
    "Why does {t} matter?",
)


def builtin_prompts() -> list[str]:
    """About a thousand instructions: every template with every topic, in a fixed order."""
    topics = [t.strip() for t in _TOPICS.replace("\n", " ").split(",") if t.strip()]
    return [template.format(t=topic) for topic in topics for template in _TEMPLATES]
