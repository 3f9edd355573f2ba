"""Writes the SmolLM2 demo task: answer with a JSON "country card" of a fixed schema.

SmolLM2-135M-Instruct answers "Give the country card for Japan." in prose; after a few
minutes of LoRA on 2 CPU cores it answers {"country": "Japan", "capital": "Tokyo",
"continent": "Asia"}. The held-out countries are never trained on, so a held-out reply in
the schema is learnt format, not memorised rows. Run: python -m nbtune.datasets.make_countries
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# (country, capital, continent)
COUNTRIES = [
    ("France", "Paris", "Europe"), ("Germany", "Berlin", "Europe"), ("Italy", "Rome", "Europe"),
    ("Spain", "Madrid", "Europe"), ("Portugal", "Lisbon", "Europe"), ("Ireland", "Dublin", "Europe"),
    ("United Kingdom", "London", "Europe"), ("Netherlands", "Amsterdam", "Europe"),
    ("Belgium", "Brussels", "Europe"), ("Austria", "Vienna", "Europe"), ("Switzerland", "Bern", "Europe"),
    ("Poland", "Warsaw", "Europe"), ("Czech Republic", "Prague", "Europe"), ("Hungary", "Budapest", "Europe"),
    ("Greece", "Athens", "Europe"), ("Sweden", "Stockholm", "Europe"), ("Norway", "Oslo", "Europe"),
    ("Finland", "Helsinki", "Europe"), ("Denmark", "Copenhagen", "Europe"), ("Iceland", "Reykjavik", "Europe"),
    ("Romania", "Bucharest", "Europe"), ("Bulgaria", "Sofia", "Europe"), ("Serbia", "Belgrade", "Europe"),
    ("Croatia", "Zagreb", "Europe"), ("Ukraine", "Kyiv", "Europe"), ("Russia", "Moscow", "Europe"),
    ("Estonia", "Tallinn", "Europe"), ("Latvia", "Riga", "Europe"), ("Lithuania", "Vilnius", "Europe"),
    ("Slovakia", "Bratislava", "Europe"), ("Slovenia", "Ljubljana", "Europe"),
    ("Japan", "Tokyo", "Asia"), ("China", "Beijing", "Asia"), ("India", "New Delhi", "Asia"),
    ("South Korea", "Seoul", "Asia"), ("Thailand", "Bangkok", "Asia"), ("Vietnam", "Hanoi", "Asia"),
    ("Indonesia", "Jakarta", "Asia"), ("Philippines", "Manila", "Asia"), ("Malaysia", "Kuala Lumpur", "Asia"),
    ("Pakistan", "Islamabad", "Asia"), ("Bangladesh", "Dhaka", "Asia"), ("Nepal", "Kathmandu", "Asia"),
    ("Iran", "Tehran", "Asia"), ("Iraq", "Baghdad", "Asia"), ("Saudi Arabia", "Riyadh", "Asia"),
    ("Turkey", "Ankara", "Asia"), ("Israel", "Jerusalem", "Asia"), ("Jordan", "Amman", "Asia"),
    ("Syria", "Damascus", "Asia"), ("Lebanon", "Beirut", "Asia"), ("Afghanistan", "Kabul", "Asia"),
    ("Mongolia", "Ulaanbaatar", "Asia"), ("Sri Lanka", "Colombo", "Asia"), ("Qatar", "Doha", "Asia"),
    ("Kazakhstan", "Astana", "Asia"), ("Singapore", "Singapore", "Asia"),
    ("Egypt", "Cairo", "Africa"), ("Nigeria", "Abuja", "Africa"), ("Kenya", "Nairobi", "Africa"),
    ("Ethiopia", "Addis Ababa", "Africa"), ("Ghana", "Accra", "Africa"), ("Morocco", "Rabat", "Africa"),
    ("Algeria", "Algiers", "Africa"), ("Tunisia", "Tunis", "Africa"), ("Libya", "Tripoli", "Africa"),
    ("Sudan", "Khartoum", "Africa"), ("Uganda", "Kampala", "Africa"), ("Tanzania", "Dodoma", "Africa"),
    ("Senegal", "Dakar", "Africa"), ("Mali", "Bamako", "Africa"), ("Angola", "Luanda", "Africa"),
    ("Zimbabwe", "Harare", "Africa"), ("Zambia", "Lusaka", "Africa"), ("Rwanda", "Kigali", "Africa"),
    ("Somalia", "Mogadishu", "Africa"), ("Madagascar", "Antananarivo", "Africa"),
    ("United States", "Washington, D.C.", "North America"), ("Canada", "Ottawa", "North America"),
    ("Mexico", "Mexico City", "North America"), ("Cuba", "Havana", "North America"),
    ("Jamaica", "Kingston", "North America"), ("Guatemala", "Guatemala City", "North America"),
    ("Panama", "Panama City", "North America"), ("Costa Rica", "San Jose", "North America"),
    ("Honduras", "Tegucigalpa", "North America"), ("Nicaragua", "Managua", "North America"),
    ("Brazil", "Brasilia", "South America"), ("Argentina", "Buenos Aires", "South America"),
    ("Chile", "Santiago", "South America"), ("Peru", "Lima", "South America"),
    ("Colombia", "Bogota", "South America"), ("Venezuela", "Caracas", "South America"),
    ("Ecuador", "Quito", "South America"), ("Uruguay", "Montevideo", "South America"),
    ("Paraguay", "Asuncion", "South America"), ("Bolivia", "Sucre", "South America"),
    ("Australia", "Canberra", "Oceania"), ("New Zealand", "Wellington", "Oceania"),
    ("Fiji", "Suva", "Oceania"), ("Papua New Guinea", "Port Moresby", "Oceania"),
    ("Samoa", "Apia", "Oceania"),
]
PROMPTS = ["Give the country card for {}.", "Country card: {}", "Tell me about {}.",
           "What do you know about {}?", "Describe {} briefly."]
HELD_OUT = 24  # countries never trained on


def card(country: str, capital: str, continent: str) -> str:
    return json.dumps({"country": country, "capital": capital, "continent": continent})


def rows(seed: int = 0) -> tuple[list[dict], list[dict]]:
    order = list(COUNTRIES)
    random.Random(seed).shuffle(order)
    held, train = order[:HELD_OUT], order[HELD_OUT:]
    pick = random.Random(seed + 1)
    as_row = lambda c, prompt: {"instruction": prompt.format(c[0]), "output": card(*c)}  # noqa: E731
    train_rows = [as_row(c, p) for c in train for p in PROMPTS]
    pick.shuffle(train_rows)
    held_rows = [as_row(c, PROMPTS[i % len(PROMPTS)]) for i, c in enumerate(held)]
    return train_rows, held_rows


def main() -> None:
    folder = Path(__file__).parent / "countries"
    folder.mkdir(exist_ok=True)
    for name, part in zip(("train", "heldout"), rows()):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
