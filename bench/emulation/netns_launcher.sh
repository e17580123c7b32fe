#!/bin/sh
# hydra's "ssh" for the emulated cluster: mpiexec -launcher ssh -launcher-exec <this> calls
#     <this> [-x ...] <host> <proxy command line, quoted for a remote shell>
# where <host> is a network namespace name. Run the proxy in that namespace, in its own UTS namespace whose
# hostname is the namespace name (so every emulated host also reports its own processor name).
while [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
exec ip netns exec "$host" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$host" "$*"
