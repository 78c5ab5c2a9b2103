"""Editing and reformatting prompts (our own): answers that copy most of their prompt.

Fix the spelling, change the tense, rename a variable, reformat a list: the kind of request
where retrieval drafters shine, because the answer is the prompt's text, lightly changed.
"""

from __future__ import annotations

from ..batch.prompts import Prompt

_EDITS = (
    (
        "Fix the spelling mistakes in this paragraph and return the corrected paragraph only:\n\n"
        "The comittee recieved the proposel on Wensday and agreed to discus it at there next meeting. "
        "Several members beleive the budjet is to small for the project, but the chairman thinks it "
        "is sufficent if the work is done seperately in two phases."
    ),
    (
        "Rewrite this text in the past tense, changing nothing else:\n\n"
        "Maria wakes up at six. She makes coffee, reads the news and walks her dog around the park. "
        "At eight she takes the bus to the office, where she answers emails and plans the week with "
        "her team. In the evening she cooks dinner and calls her brother."
    ),
    (
        "Rename the variable `tmp` to `total` in this Python function and return the whole function:\n\n"
        "def sum_prices(items):\n    tmp = 0\n    for item in items:\n        if item.price > 0:\n"
        "            tmp += item.price * item.quantity\n    print('total:', tmp)\n    return tmp\n"
    ),
    (
        "Turn this comma-separated list into a bulleted Markdown list, one item per line, keeping "
        "the order:\n\napples, pears, bananas, cherries, plums, oranges, lemons, limes, grapes, "
        "peaches, apricots, mangoes"
    ),
    (
        "Convert these lines to a JSON array of objects with the keys name and age:\n\n"
        "Alice 34\nBob 27\nCarol 45\nDavid 31\nEve 29\nFrank 52"
    ),
    (
        "Change every sentence of this text from passive to active voice:\n\n"
        "The report was written by the interns. The results were checked by the manager. "
        "The final version was approved by the board, and the summary was sent to all employees "
        "by the secretary."
    ),
    (
        "Rewrite this paragraph in British English spelling, changing nothing else:\n\n"
        "The color of the theater was gray, and the neighbors organized a program to honor the "
        "center's favorite labor leader. They analyzed the catalog and realized the defense budget "
        "was traveling in the wrong direction."
    ),
    (
        "Sort these names alphabetically and return them one per line:\n\n"
        "Oliver\nEmma\nLiam\nAva\nNoah\nSophia\nJames\nIsabella\nLucas\nMia"
    ),
    (
        "Rename the function `calc` to `compute_area` everywhere in this code and return the code:\n\n"
        "def calc(width, height):\n    return width * height\n\n\n"
        "rooms = [(3, 4), (5, 2), (6, 6)]\nareas = [calc(w, h) for w, h in rooms]\n"
        "print(sum(areas), max(calc(w, h) for w, h in rooms))\n"
    ),
    (
        "Add a period at the end of every line that lacks one and return the text:\n\n"
        "The meeting starts at nine\nBring your laptop.\nLunch is provided\n"
        "Parking is available behind the building\nThe session ends at four."
    ),
    (
        "Rewrite this text in the first person (I), changing nothing else:\n\n"
        "He grew up in a small town by the sea. He learned to sail before he could ride a bike, and "
        "he spent every summer on the water with his grandfather. Later he moved to the city, but he "
        "still sails whenever he can."
    ),
    (
        "Convert this Markdown table to CSV:\n\n"
        "| city | country | population |\n|---|---|---|\n| Paris | France | 2100000 |\n"
        "| Berlin | Germany | 3600000 |\n| Madrid | Spain | 3300000 |\n| Rome | Italy | 2800000 |"
    ),
    (
        "Fix the grammar of these sentences and return them, one per line:\n\n"
        "She don't like apples.\nThey was at the station when the train arrive.\n"
        "Me and him goes to school together.\nThe dogs is barking since morning.\n"
        "I has finished my homework yesterday."
    ),
    (
        "Replace every occurrence of the word 'client' with 'customer' in this text:\n\n"
        "Every client receives a welcome email. If a client has questions, the client can call our "
        "support line. We record each client's feedback and send the client a summary once a month."
    ),
    (
        "Reformat this address into four lines (name, street, city and postcode, country):\n\n"
        "Dr. Jane Smith, 42 Baker Street, London NW1 6XE, United Kingdom"
    ),
    (
        "Convert this numbered list into a single sentence, keeping the order:\n\n"
        "1. Preheat the oven to 200 degrees.\n2. Mix the flour, sugar and butter.\n"
        "3. Add two eggs.\n4. Pour the batter into a tin.\n5. Bake for thirty minutes."
    ),
    (
        "Change the dates in this text from MM/DD/YYYY to YYYY-MM-DD and return the text:\n\n"
        "The contract starts on 03/15/2024 and ends on 09/30/2025. Payments are due on 04/01/2024, "
        "07/01/2024 and 10/01/2024. The review meeting is on 12/12/2024."
    ),
    (
        "Rewrite this JavaScript using const instead of var, changing nothing else:\n\n"
        "var base = 10;\nvar rate = 0.2;\nvar items = [3, 5, 8];\n"
        "var total = items.reduce(function (a, b) { return a + b; }, base);\n"
        "var tax = total * rate;\nconsole.log(total + tax);\n"
    ),
    (
        "Put this text in title case and return it:\n\n"
        "a short history of the printing press\nthe rise and fall of the roman empire\n"
        "how to grow tomatoes on a balcony\nten lessons from a life at sea"
    ),
    (
        "Remove the filler words (um, uh, like, you know) from this transcript and return it:\n\n"
        "So, um, we started the project in, uh, March, and, like, the first month was, you know, "
        "mostly planning. Then we, um, built the prototype and, uh, tested it with, like, twenty users."
    ),
    (
        "Translate the comments of this code from French to English, changing nothing else:\n\n"
        "# calcule la moyenne d'une liste\ndef moyenne(valeurs):\n    # la liste ne doit pas être vide\n"
        "    assert valeurs\n    # somme divisée par le nombre d'éléments\n"
        "    return sum(valeurs) / len(valeurs)\n"
    ),
    (
        "Rewrite this list of tasks as a Markdown checklist (- [ ] item), keeping the order:\n\n"
        "buy milk; call the plumber; renew the passport; book the dentist; water the plants; "
        "pay the electricity bill; return the library books"
    ),
)


def editing_prompts() -> list[Prompt]:
    """The editing and reformatting prompts, category ``editing``."""
    return [Prompt(f"edit-{i}", text, "editing") for i, text in enumerate(_EDITS)]
