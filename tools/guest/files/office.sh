#!/bin/sh
# Office-like editing, for block traces (tools/chunksim): a scaled-down imitation of the papers' office
# benchmarks (SYSmark SOP, ISR-3's CDA): open documents, find and replace, sort a spreadsheet, read mail and
# web pages, append to documents with an autosave, archive a folder, with think time between operations.
#
#   office.sh setup          make the documents in /data/office (from the source archive), then sync
#   office.sh run [THINK]    the editing session; THINK seconds of think time between operations (default 1,
#                            CDA used 10); prints  ISR-OFFICE ok ops=N seconds=S  (or ISR-OFFICE fail reason=W)
#
# Document sizes follow CDA's data set: a 760 KB novel, a 570 KB and a ~1.7 MB spreadsheet, a 116 KB
# presentation, ~450 KB of web pages, plus reports, memos and a mailbox. The text is cut from the source
# archive, so it is deterministic; the spreadsheets come from awk with a fixed seed.
set -u
here=$(dirname "$0")
. "$here/config"
docs=/data/office
scratch=/data/office-src

fail() {
    echo "ISR-OFFICE fail reason=$1"
    exit 1
}

# cut NAME KIB SKIP_KIB: a document of KIB KiB of text, taken SKIP_KIB KiB into the concatenated sources
cut_doc() {
    dd if="$scratch/all.txt" of="$docs/$1" bs=1024 skip="$3" count="$2" 2>/dev/null || fail "cut-$1"
}

setup() {
    rm -rf "$docs" "$scratch"
    mkdir -p "$docs/reports" "$docs/memos" "$docs/web" "$docs/mail" "$scratch" || fail mkdir
    tar -xzf "$ARCHIVE" -C "$scratch" || fail unpack
    # All sources in name order, repeated until there is enough text for every document.
    find "$scratch" -type f -name '*.py' | sort >"$scratch/list"
    : >"$scratch/all.txt"
    while [ "$(wc -c <"$scratch/all.txt")" -lt 6000000 ]; do
        xargs cat <"$scratch/list" >>"$scratch/all.txt" || fail concat
    done
    cut_doc novel.txt 760 0
    cut_doc slides.txt 116 800
    i=1
    while [ "$i" -le 12 ]; do
        cut_doc "reports/report$i.txt" $((i * 24)) $((1000 + i * 300))
        i=$((i + 1))
    done
    i=1
    while [ "$i" -le 20 ]; do
        cut_doc "memos/memo$i.txt" $((2 + i % 7)) $((5000 + i * 10))
        i=$((i + 1))
    done
    i=1
    while [ "$i" -le 36 ]; do
        cut_doc "web/page$i.html" $((8 + i % 9)) $((5300 + i * 20))
        i=$((i + 1))
    done
    cut_doc mail/inbox 2048 3000
    awk 'BEGIN { srand(1); for (i = 1; i <= 4783; i++)
        printf "%d,%d,%.4f,item%d,%d,%.6f,%d,region%d\n", i, int(rand() * 100000), rand() * 1e6, i % 997,
               int(rand() * 500), rand(), int(rand() * 1e9), i % 13 }' >"$docs/sheet1.csv" || fail sheet1
    awk 'BEGIN { srand(2); for (i = 1; i <= 4095; i++) { line = i
        for (j = 1; j < 100; j++) line = line "," int(rand() * 10000); print line } }' >"$docs/sheet2.csv" ||
        fail sheet2
    rm -rf "$scratch"
    sync || fail sync
    echo "ISR-OFFICE setup files=$(find "$docs" -type f | wc -l) kib=$(du -sk "$docs" | cut -f1)"
}

ops=0
think() {
    ops=$((ops + 1))
    sleep "$THINK"
}

# autosave: a small append to the document being edited, made durable
autosave() {
    echo "autosave $ops: $(date +%s)" >>"$1" || fail autosave
    sync
}

session() {
    cd "$docs" || fail cd
    # open the novel, count words, find and replace, keep typing with autosaves
    wc -w novel.txt >/dev/null || fail open-novel; think
    sed -i 's/self/this/g' novel.txt || fail replace-novel; think
    autosave novel.txt; think
    grep -c 'def ' novel.txt >/dev/null; think
    autosave novel.txt; think
    # the small spreadsheet: sort by a column, save; the big one: sum a column, edit a cell, save
    sort -t, -k3 -n sheet1.csv >sheet1.tmp && mv sheet1.tmp sheet1.csv || fail sort-sheet1; think
    awk -F, '{ s += $7 } END { print s }' sheet1.csv >/dev/null; think
    awk -F, '{ s += $50 } END { print s }' sheet2.csv >/dev/null || fail sum-sheet2; think
    sed -i '2000s/^[0-9]*,/2000,/' sheet2.csv || fail edit-sheet2; think
    # the presentation: edit two slides' worth of text
    sed -i '100,140s/return/yield/' slides.txt || fail edit-slides; think
    autosave slides.txt; think
    # mail: read the inbox, search it, file a reply
    grep -c 'import' mail/inbox >/dev/null; think
    tail -c 20000 mail/inbox >/dev/null; think
    printf 'From: isr\nSubject: re: %s\n\n%s\n' "$ops" "$(head -c 3000 reports/report1.txt)" >>mail/inbox ||
        fail reply; sync; think
    # the web: read a dozen pages
    i=1
    while [ "$i" -le 36 ]; do
        cat "web/page$i.html" >/dev/null
        [ $((i % 3)) -eq 0 ] && think
        i=$((i + 1))
    done
    # reports: open each, edit every third, save
    i=1
    while [ "$i" -le 12 ]; do
        wc -l "reports/report$i.txt" >/dev/null || fail "open-report$i"
        if [ $((i % 3)) -eq 0 ]; then
            sed -i 's/None/null/g' "reports/report$i.txt" || fail "edit-report$i"
            autosave "reports/report$i.txt"
        fi
        think
        i=$((i + 1))
    done
    # memos: read all, write three new ones, delete two old ones
    cat memos/memo*.txt >/dev/null; think
    i=1
    while [ "$i" -le 3 ]; do
        head -c $((2048 * i)) novel.txt >"memos/new$i.txt" || fail "new-memo$i"
        sync; think
        i=$((i + 1))
    done
    rm -f memos/memo3.txt memos/memo7.txt; think
    # back to the novel, then archive the reports (WinZip in SOP)
    sed -i '5000,5100s/class/struct/' novel.txt || fail edit-novel; think
    autosave novel.txt; think
    tar -czf reports.tgz reports || fail archive; think
    sync
}

case "${1:-}" in
setup)
    setup
    ;;
run)
    THINK=${2:-1}
    [ -d "$docs" ] || fail no-documents
    read -r start idle </proc/uptime
    session
    read -r end idle </proc/uptime
    seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
    echo "ISR-OFFICE ok ops=$ops seconds=$seconds"
    ;;
*)
    echo "usage: office.sh setup | office.sh run [THINK_SECONDS]" >&2
    exit 2
    ;;
esac
