#!/bin/sh
# The ISR test workload: a small, repeatable imitation of someone working with source code.
#
# Unpacks the source archive, searches it, checksums it, copies the tree, writes new files, deletes some,
# syncs, drops the page cache and checks everything it wrote by reading it back from the disk. Prints one
# line for the host to parse:
#
#   ISR-WORKLOAD ok files=N matches=M digest=HEX copied=N written=W deleted=D seconds=S
#   ISR-WORKLOAD fail reason=WORD
#
# files, matches and digest depend only on the archive, so the host computes them too and compares:
#   matches = lines containing "def ", "import " or "class " (grep -F, counted per line)
#   digest  = sha256 of the file "sums": one "<sha256>  ./<path>" line per file, sorted by path
# Safe to run again: each run starts from an empty /data/work.
set -u
here=$(dirname "$0")
. "$here/config"
work=/data/work

fail() {
    echo "ISR-WORKLOAD fail reason=$1"
    exit 1
}

read -r start idle </proc/uptime
rm -rf "$work" || fail rm-old
mkdir -p "$work/src" "$work/new" || fail mkdir
cd "$work" || fail cd

# unpack
tar -xzf "$ARCHIVE" -C src || fail unpack
files=$(find src -type f | wc -l)

# search
matches=$(grep -r -c -F -e 'def ' -e 'import ' -e 'class ' src | awk -F: '{ n += $NF } END { print n + 0 }')

# checksum: every file, then the list (names are plain ASCII without spaces: the builder made sure)
(cd src && find . -type f | sort | xargs sha256sum) >sums || fail checksum
digest=$(sha256sum sums | cut -d' ' -f1)

# copy the tree
cp -a src copy || fail copy
copied=$(find copy -type f | wc -l)

# write new files (random: user data does not compress), remembering their checksums
i=0
while [ "$i" -lt "$NEW_FILES" ]; do
    dd if=/dev/urandom of="new/file$i" bs=1024 count="$NEW_FILE_KIB" 2>/dev/null || fail write
    i=$((i + 1))
done
(cd new && sha256sum file*) >new.sums || fail checksum-new
written=$i

# delete every third file of the copy and every other new file
find copy -type f | sort | awk 'NR % 3 == 0' >deleted.list
xargs rm -f <deleted.list || fail delete
deleted=$(wc -l <deleted.list)
i=1
while [ "$i" -lt "$NEW_FILES" ]; do
    rm -f "new/file$i"
    i=$((i + 2))
done

# make it durable, forget the cache, and check what is on the disk
sync || fail sync
echo 3 >/proc/sys/vm/drop_caches
(cd src && sha256sum -c ../sums >/dev/null) || fail verify-src
sed 's|^copy/|./|' deleted.list >deleted.rel
awk 'NR == FNR { gone[$1] = 1; next } !($2 in gone)' deleted.rel sums >kept.sums
(cd copy && sha256sum -c ../kept.sums >/dev/null) || fail verify-copy
(cd new && grep -E 'file[0-9]*[02468]$' ../new.sums | sha256sum -c >/dev/null) || fail verify-new
remaining=$(find copy -type f | wc -l)
[ "$((remaining + deleted))" -eq "$copied" ] || fail verify-copy-count
[ "$remaining" -eq "$(wc -l <kept.sums)" ] || fail verify-copy-count
[ "$copied" -eq "$files" ] || fail copy-count

read -r end idle </proc/uptime
seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
echo "ISR-WORKLOAD ok files=$files matches=$matches digest=$digest copied=$copied written=$written deleted=$deleted seconds=$seconds"
