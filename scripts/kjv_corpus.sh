#!/usr/bin/env bash
# The training text of the bundled model: the King James Version of the Bible (1611; public
# domain, see README "Bundled model"), from Debian's bible-kjv-text package, dumped to plain text
# with the same source's `bible` program (package bible-kjv). Needs apt-get (any Debian/Ubuntu).
#
#   bash scripts/kjv_corpus.sh OUT.txt
#
# Output: one verse per line (verse numbers and line wrapping removed), a blank line between
# chapters, the book name before each book's first chapter.
set -euo pipefail
out=${1:?usage: scripts/kjv_corpus.sh OUT.txt}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download bible-kjv bible-kjv-text >/dev/null)
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
"$work/root/usr/bin/bible" -p "$work/root/usr/lib" "gen1:1-rev22:21" > "$work/raw.txt"
python3 - "$work/raw.txt" "$out" <<'PY'
import re, sys
raw, out = sys.argv[1:]
verses, book = [], None
with open(raw) as f:
  for line in f:
    line = line.rstrip("\n")
    header = re.fullmatch(r"(\S.*?) (\d+)", line)
    if header:  # "Genesis 1", "1 Kings 3", "Song of Solomon 2"
      name = header.group(1)
      verses.append("")  # blank line between chapters
      if name != book:
        book = name
        verses.append(name)
      continue
    verse = re.match(r"\s+\d+ (.*)", line)
    if verse:
      verses.append(verse.group(1))
    elif line.strip():  # continuation of a wrapped verse
      verses[-1] += " " + line.strip()
with open(out, "w") as f:
  f.write("\n".join(verses).strip() + "\n")
PY
echo "wrote $(wc -c < "$out") bytes to $out"
