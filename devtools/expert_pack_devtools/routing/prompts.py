"""A fixed prompt set for routing measurements: natural text of varied topics and styles, ~150-250 tokens
each, so that statistics are comparable between models and runs."""

PROMPTS = [
    "The history of the printing press begins long before Gutenberg. Woodblock printing spread across East Asia "
    "centuries earlier, and movable type made of clay and later metal appeared in China and Korea. What changed in "
    "fifteenth-century Europe was the combination of an adjustable type mould, an oil-based ink that clung to metal, "
    "and a screw press adapted from wine making. Together they made it cheap to produce hundreds of identical copies, "
    "and within fifty years printers were working in more than two hundred cities. Pamphlets, almanacs and grammar "
    "books travelled farther than any manuscript had, and ideas that once stayed in a monastery library now reached "
    "merchants, students and artisans.",

    "To make a simple tomato sauce, warm three tablespoons of olive oil in a wide pan over medium heat. Add a sliced "
    "onion and a pinch of salt, and cook it slowly until it is soft and golden, about ten minutes. Stir in two cloves "
    "of chopped garlic and cook for one more minute, taking care that it does not burn. Pour in a large can of whole "
    "peeled tomatoes, crush them with a wooden spoon, and let the sauce simmer gently for twenty to thirty minutes. "
    "Taste it, adjust the salt, and finish with a handful of torn basil leaves and a little butter if you like a "
    "rounder flavour. It keeps for several days in the refrigerator.",

    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list in linear time.\"\"\"\n"
    "    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n"
    "    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n\n\ndef merge_sort(xs):\n    if len(xs) <= 1:\n"
    "        return xs\n    mid = len(xs) // 2\n    return merge_sorted(merge_sort(xs[:mid]), merge_sort(xs[mid:]))\n",

    "Dear Ms. Alvarez, thank you for your letter of March 3 regarding the delayed shipment of the laboratory "
    "centrifuges. I have looked into the matter with our logistics team. The units left our warehouse on schedule, "
    "but the carrier held them at the regional hub for customs documentation that should have been attached to the "
    "freight bill. We have now supplied the missing certificate, and the carrier has confirmed delivery for the "
    "morning of March 12. As a gesture of goodwill we will extend the warranty on all three units by one year. "
    "Please do not hesitate to contact me directly if anything else is unclear. Kind regards, Daniel Brooks.",

    "Photosynthesis takes place in two linked stages. In the light-dependent reactions, which occur in the thylakoid "
    "membranes of the chloroplast, pigments such as chlorophyll absorb light energy and use it to split water "
    "molecules, releasing oxygen and producing the energy carriers ATP and NADPH. In the Calvin cycle, which runs in "
    "the surrounding stroma, the enzyme RuBisCO fixes carbon dioxide onto a five-carbon sugar, and the ATP and NADPH "
    "from the first stage power the reduction of the resulting molecules into three-carbon sugars. Some of these "
    "sugars leave the cycle to build glucose and starch, while the rest regenerate the starting molecule.",

    "The old lighthouse keeper climbed the spiral stairs for the last time on a grey morning in November. The lamp had "
    "been automated years ago, but he had stayed on to paint the railings and log the passing ships, mostly out of "
    "habit. At the top he wiped the salt from the glass and looked out at the harbour, where the fishing boats were "
    "already heading home ahead of the storm. He thought about the winter of the great freeze, when the bay had turned "
    "white and a boy had walked all the way out to the rocks on a dare. Then he closed his notebook, set the key on "
    "the windowsill, and went down without looking back.",

    "Interest rates influence the economy through several channels. When a central bank raises its policy rate, "
    "borrowing becomes more expensive for households and firms, which tends to reduce spending on homes, cars and new "
    "equipment. Higher rates also make saving more attractive and can strengthen the currency, which lowers the price "
    "of imports and makes exports less competitive. Asset prices often fall as future earnings are discounted more "
    "heavily. These effects take time to appear, typically between one and two years, which is why central banks try "
    "to act on forecasts of inflation rather than on the figures they observe today.",

    "Question: A train leaves the station at 9:40 and travels 180 kilometres at an average speed of 72 kilometres per "
    "hour. At what time does it arrive? Answer: The journey takes 180 divided by 72, which is 2.5 hours, or two hours "
    "and thirty minutes. Adding this to 9:40 gives 12:10. Question: If the return trip is made at 90 kilometres per "
    "hour, how much time is saved? Answer: The return trip takes 180 divided by 90, which is exactly two hours, so "
    "thirty minutes are saved compared with the outbound journey.",

    "The committee met on Tuesday to review the proposal for a new cycling lane along the river road. Supporters argued "
    "that the lane would reduce traffic on the bridge and give children a safe route to the secondary school. Several "
    "shop owners worried that removing twenty parking spaces would cost them customers, and one resident asked whether "
    "the trees on the embankment would have to be cut down. The engineer explained that the design keeps every tree "
    "and moves the parking to a side street two hundred metres away. After a long discussion the committee agreed to "
    "run a six-month trial and to publish traffic counts every month.",

    "In mathematics, a group is a set together with an operation that combines any two elements to form a third, in "
    "such a way that the operation is associative, there is an identity element, and every element has an inverse. "
    "The integers under addition form a group, with zero as the identity and the negative of each number as its "
    "inverse. The symmetries of a square, including rotations and reflections, form a group with eight elements under "
    "composition. Groups appear throughout mathematics and physics because they capture the idea of symmetry, and "
    "the study of how they act on other objects has led to results in geometry, number theory and chemistry.",

    "Traveller's notes, day six. We left the valley before sunrise and followed the shepherds' path up to the pass. The "
    "snow was firm in the shade but soft and heavy where the sun reached it, and by noon every step took twice the "
    "effort. At the top a small stone hut offered shelter from the wind, and we shared bread, hard cheese and dried "
    "apricots with two students from the coast who were walking the same route in the other direction. They warned "
    "us that the bridge below the glacier had been washed away in spring, so we will take the longer trail through "
    "the pine forest tomorrow.",

    "Good software documentation answers three questions quickly: what does this do, how do I use it, and what can go "
    "wrong. Start with a short example that a new user can copy and run in under a minute. Then describe each option "
    "in the order a reader is likely to need it, with the default value and the reason someone would change it. List "
    "the error messages a user may see and what each one means. Keep the documentation next to the code, review it in "
    "the same change as the code it describes, and delete sections that no longer apply rather than leaving them to "
    "mislead the next reader.",
]
