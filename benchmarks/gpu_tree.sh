# Sourced by the gpu_*.sh scripts: run the package from this checkout on a machine where nothing is installed.
# The package is laid out as an installed wheel would be (tabfm/, tabfm/parallel, tabfm/data) through symlinks in
# $WORK/pkg, so paths that model.py and evaluate.py resolve from __file__ still land in this repository (configs,
# datasets); the caller then works from $WORK, not the repository root, whose tabfm/ folder would shadow the tree.
PKG=$WORK/pkg
rm -rf "$PKG" && mkdir -p "$PKG/tabfm"
for f in "$REPO"/tabfm/*; do ln -s "$f" "$PKG/tabfm/"; done
ln -s "$REPO/parallel" "$PKG/tabfm/parallel"
ln -s "$REPO/data" "$PKG/tabfm/data"
export PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH}
cd "$WORK" || exit 1
