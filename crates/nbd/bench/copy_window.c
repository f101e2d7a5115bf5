/* The CPU's `rep movsb` (what the kernel copies user memory with) per MiB,
 * by how far the destination lies past the source modulo 4096. On the
 * development host (AMD EPYC, FSRM) 1..31 bytes is 5-10x slower than any
 * other distance: docs/benchmarks.md, "NBD".
 *
 *   gcc -O2 -o /tmp/copy_window crates/nbd/bench/copy_window.c
 *   /tmp/copy_window 0 0 4 16 28 31 32 48 64 4064 4080 4112
 *   (first argument: the source's offset in its page; then destination offsets)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void movsb(void *d, const void *s, size_t n)
{
    asm volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n) : : "memory");
}

int main(int argc, char **argv)
{
    size_t src_size = 64 << 20, dst_size = 8 << 20, n = 1 << 20;
    char *src = aligned_alloc(4096, src_size + 8192), *dst = aligned_alloc(4096, dst_size + 8192);
    if (argc < 3 || !src || !dst) {
        fprintf(stderr, "usage: %s SRC_OFFSET DST_OFFSET...\n", argv[0]);
        return 2;
    }
    memset(src, 1, src_size + 8192);
    memset(dst, 2, dst_size + 8192);
    int so = atoi(argv[1]);
    for (int a = 2; a < argc; a++) {
        int dd = atoi(argv[a]);
        double best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            double t0 = now();
            int k = 60;
            for (int i = 0; i < k; i++)
                movsb(dst + ((i % 8) << 20) + dd, src + (((size_t)i * 37 % 63) << 20) + so, n);
            double t = (now() - t0) * 1e6 / k;
            if (t < best)
                best = t;
        }
        printf("src+%d dst+%-5d (dst-src mod 4096 = %4d): %7.1f us/MiB\n", so, dd,
               ((dd - so) % 4096 + 4096) % 4096, best);
    }
    return 0;
}
