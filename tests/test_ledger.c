/* test_ledger.c — the memory ledger: exact current and peak bytes per
 * category for small and huge-page allocations, alignment, bad frees, many
 * live blocks; the arena: bump allocation, reset, capacity errors. */
#include "lz_test.h"

#include <stdint.h> /* uintptr_t */
#include <stdlib.h> /* malloc for a foreign pointer */

#define MIB (1 << 20)

LZ_TEST(ledger_every_category_exact) {
  const int64_t big = 3 * MIB + 5, small = 1000;
  CHECK_EQ_INT(lz_mem_huge_threshold(), 2 * MIB);
  for (int cat = 0; cat < LZ_MEM_COUNT; cat++) {
    int64_t other[LZ_MEM_COUNT];
    for (int c = 0; c < LZ_MEM_COUNT; c++) other[c] = lz_mem_current((lz_mem_category)c);
    lz_mem_reset_peak();
    const int64_t c0 = lz_mem_current((lz_mem_category)cat), t0 = lz_mem_total_current();
    CHECK_EQ_INT(lz_mem_peak((lz_mem_category)cat), c0);

    void *s = NULL, *b = NULL;
    CHECK_OK(lz_mem_alloc(&s, (size_t)small, (lz_mem_category)cat));
    CHECK(s != NULL && (uintptr_t)s % 64 == 0);
    CHECK_EQ_INT(lz_mem_current((lz_mem_category)cat) - c0, small);
    CHECK_EQ_INT(lz_mem_peak((lz_mem_category)cat) - c0, small);
    CHECK_OK(lz_mem_alloc(&b, (size_t)big, (lz_mem_category)cat));
    CHECK(b != NULL && (uintptr_t)b % (2 * MIB) == 0);
    memset(b, 0xab, (size_t)big); /* all of it is really there */
    memset(s, 0xcd, (size_t)small);
    CHECK_EQ_INT(lz_mem_current((lz_mem_category)cat) - c0, small + big);
    CHECK_EQ_INT(lz_mem_peak((lz_mem_category)cat) - c0, small + big);
    CHECK_EQ_INT(lz_mem_total_current() - t0, small + big);
    /* The other categories did not move. */
    for (int c = 0; c < LZ_MEM_COUNT; c++)
      if (c != cat) CHECK_EQ_INT(lz_mem_current((lz_mem_category)c), other[c]);

    CHECK_OK(lz_mem_free(s));
    CHECK_EQ_INT(lz_mem_current((lz_mem_category)cat) - c0, big);
    CHECK_EQ_INT(lz_mem_peak((lz_mem_category)cat) - c0, small + big); /* peak stays */
    CHECK_OK(lz_mem_free(b));
    CHECK_EQ_INT(lz_mem_current((lz_mem_category)cat), c0);
    CHECK_EQ_INT(lz_mem_peak((lz_mem_category)cat) - c0, small + big);
    lz_mem_reset_peak();
    CHECK_EQ_INT(lz_mem_peak((lz_mem_category)cat), c0);
  }
  CHECK(strcmp(lz_mem_category_name(LZ_MEM_OPTIMIZER), "optimizer") == 0);
  CHECK(strcmp(lz_mem_category_name(LZ_MEM_COUNT), "unknown") == 0);
}

/* The threshold itself takes the huge-page path; one byte less does not
 * (but is still 64-byte aligned); zero bytes is a valid, freeable block. */
LZ_TEST(ledger_threshold_and_zero) {
  const int64_t c0 = lz_mem_current(LZ_MEM_COMM);
  void *at = NULL, *below = NULL, *zero = NULL;
  CHECK_OK(lz_mem_alloc(&at, 2 * MIB, LZ_MEM_COMM));
  CHECK((uintptr_t)at % (2 * MIB) == 0);
  CHECK_OK(lz_mem_alloc(&below, 2 * MIB - 1, LZ_MEM_COMM));
  CHECK((uintptr_t)below % 64 == 0);
  CHECK_OK(lz_mem_alloc(&zero, 0, LZ_MEM_COMM));
  CHECK(zero != NULL);
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_COMM) - c0, 4 * MIB - 1);
  CHECK_OK(lz_mem_free(at));
  CHECK_OK(lz_mem_free(below));
  CHECK_OK(lz_mem_free(zero));
  CHECK_OK(lz_mem_free(NULL));
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_COMM), c0);
}

LZ_TEST(ledger_bad_frees_and_args) {
  const int64_t t0 = lz_mem_total_current();
  int on_stack = 0;
  void *heap = malloc(64);
  CHECK_ERR(lz_mem_free(&on_stack), LZ_ERR_INVALID, "mem_free:");
  CHECK_ERR(lz_mem_free(heap), LZ_ERR_INVALID, "was not allocated by lz_mem_alloc");
  free(heap);
  void *p = NULL;
  CHECK_OK(lz_mem_alloc(&p, 4096, LZ_MEM_PARAMS));
  CHECK_ERR(lz_mem_free((char *)p + 64), LZ_ERR_INVALID, "mem_free:"); /* interior */
  CHECK_OK(lz_mem_free(p));
  CHECK_ERR(lz_mem_free(p), LZ_ERR_INVALID, "or was freed already"); /* twice */
  /* 1 is the table's mark for a deleted slot: not a block either. */
  CHECK_ERR(lz_mem_free((void *)1), LZ_ERR_INVALID, "mem_free:");
  CHECK_EQ_INT(lz_mem_total_current(), t0);

  CHECK_ERR(lz_mem_alloc(&p, 64, LZ_MEM_COUNT), LZ_ERR_INVALID, "mem_alloc: category 7");
  CHECK(p == NULL);
  CHECK_ERR(lz_mem_alloc(NULL, 64, LZ_MEM_PARAMS), LZ_ERR_INVALID, "mem_alloc: out is NULL");
  /* A size that would wrap when rounded up to pages. */
  CHECK_ERR(lz_mem_alloc(&p, SIZE_MAX, LZ_MEM_PARAMS), LZ_ERR_NOMEM, "mem_alloc:");
  CHECK_ERR(lz_mem_alloc(&p, SIZE_MAX - 4096, LZ_MEM_PARAMS), LZ_ERR_NOMEM, "mem_alloc:");
  CHECK(p == NULL);
  CHECK_EQ_INT(lz_mem_total_current(), t0);
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_COUNT), 0);
}

/* Enough live blocks to grow the address table several times, freed in an
 * order that leaves deleted slots in every probe chain. */
LZ_TEST(ledger_many_blocks) {
  enum { N = 5000 };
  static void *p[N];
  const int64_t c0 = lz_mem_current(LZ_MEM_ACTIVATIONS);
  int64_t sum = 0;
  for (int i = 0; i < N; i++) {
    CHECK_OK(lz_mem_alloc(&p[i], (size_t)(i % 97 + 1), LZ_MEM_ACTIVATIONS));
    sum += i % 97 + 1;
  }
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_ACTIVATIONS) - c0, sum);
  for (int i = 0; i < N; i += 2) CHECK_OK(lz_mem_free(p[i]));
  for (int i = 0; i < N; i += 2) CHECK_OK(lz_mem_alloc(&p[i], 8, LZ_MEM_ACTIVATIONS));
  for (int i = N - 1; i >= 0; i--) CHECK_OK(lz_mem_free(p[i]));
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_ACTIVATIONS), c0);
}

LZ_TEST(ledger_arena) {
  const int64_t act0 = lz_mem_current(LZ_MEM_ACTIVATIONS);
  lz_arena *a = NULL;
  CHECK_OK(lz_arena_new(&a, 4096, LZ_MEM_ACTIVATIONS));
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_ACTIVATIONS) - act0, 4096);
  CHECK_EQ_INT(lz_arena_capacity(a), 4096);
  CHECK_EQ_INT(lz_arena_used(a), 0);

  lz_tensor *t1 = NULL, *t2 = NULL, *t3 = NULL;
  const int64_t s10[1] = {10}, s100[1] = {100}, s1000[1] = {1000};
  CHECK_OK(lz_arena_tensor(a, &t1, LZ_F32, 1, s10));
  CHECK_EQ_INT(lz_arena_used(a), 64); /* 40 bytes, rounded to 64 */
  CHECK_OK(lz_arena_tensor(a, &t2, LZ_BF16, 1, s100));
  CHECK_EQ_INT(lz_arena_used(a), 64 + 256);
  CHECK((char *)t2->data - (char *)t1->data == 64 && (uintptr_t)t2->data % 64 == 0);
  CHECK(t2->dtype == LZ_BF16 && t2->storage == NULL);
  memset(t2->data, 0, lz_tensor_bytes(t2));
  CHECK_OK(lz_tensor_free(t1)); /* arena tensors: a no-op */

  CHECK_ERR(lz_arena_tensor(a, &t3, LZ_F32, 1, s1000), LZ_ERR_NOMEM,
            "arena: 4032 bytes asked with 320 of 4096 in use; make the arena larger");
  CHECK(t3 == NULL);
  CHECK_EQ_INT(lz_arena_used(a), 320);
  CHECK_EQ_INT(lz_arena_peak(a), 320);

  void *start = t1->data;
  CHECK_OK(lz_arena_reset(a));
  CHECK_EQ_INT(lz_arena_used(a), 0);
  CHECK_EQ_INT(lz_arena_peak(a), 320);
  CHECK_OK(lz_arena_tensor(a, &t3, LZ_F32, 1, s1000)); /* fits after the reset */
  CHECK(t3->data == start);
  CHECK_EQ_INT(lz_arena_peak(a), 4032);
  const int64_t neg[1] = {-1};
  CHECK_ERR(lz_arena_tensor(a, &t3, LZ_F32, 1, neg), LZ_ERR_INVALID, "arena_tensor: dimension 0");

  /* rewound: the bytes taken since a mark go to the next tensors */
  CHECK_OK(lz_arena_reset(a));
  CHECK_OK(lz_arena_tensor(a, &t1, LZ_F32, 1, s10));
  const size_t mark = lz_arena_used(a);
  CHECK_OK(lz_arena_tensor(a, &t2, LZ_F32, 1, s100));
  void *dead = t2->data;
  CHECK_OK(lz_arena_rewind(a, mark));
  CHECK_EQ_INT(lz_arena_used(a), 64);
  CHECK_OK(lz_arena_tensor(a, &t3, LZ_F32, 1, s10));
  CHECK(t3->data == dead && t1->data == start);
  CHECK_ERR(lz_arena_rewind(a, 1024), LZ_ERR_INVALID, "arena_rewind: 1024 bytes; give what");
  CHECK_ERR(lz_arena_rewind(a, 32), LZ_ERR_INVALID, "arena_rewind: 32 bytes");

  CHECK_OK(lz_arena_free(a));
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_ACTIVATIONS), act0);
  CHECK_OK(lz_arena_free(NULL));
}

/* Arenas over one borrowed buffer: bump allocation inside it, no bytes of
 * their own on the ledger's activations, the buffer untouched by free. */
LZ_TEST(ledger_arena_wrap) {
  void *buf = NULL;
  CHECK_OK(lz_mem_alloc(&buf, 4096, LZ_MEM_ACTIVATIONS));
  const int64_t act0 = lz_mem_current(LZ_MEM_ACTIVATIONS);
  lz_arena *lo = NULL, *hi = NULL;
  CHECK_OK(lz_arena_wrap(&lo, buf, 1024));
  CHECK_OK(lz_arena_wrap(&hi, (char *)buf + 1024, 3072));
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_ACTIVATIONS), act0);
  CHECK_EQ_INT(lz_arena_capacity(hi), 3072);

  lz_tensor *a = NULL, *b = NULL, *c = NULL;
  const int64_t s200[1] = {200}, s300[1] = {300};
  CHECK_OK(lz_arena_tensor(lo, &a, LZ_F32, 1, s200));
  CHECK(a->data == buf);
  CHECK_OK(lz_arena_tensor(hi, &b, LZ_F32, 1, s300));
  CHECK(b->data == (char *)buf + 1024);
  CHECK_ERR(lz_arena_tensor(lo, &c, LZ_F32, 1, s200), LZ_ERR_NOMEM,
            "arena: 832 bytes asked with 832 of 1024 in use; make the arena larger");
  CHECK_OK(lz_arena_reset(lo));
  CHECK_OK(lz_arena_tensor(lo, &c, LZ_F32, 1, s200));
  CHECK(c->data == buf);

  lz_arena *odd = NULL;
  CHECK_ERR(lz_arena_wrap(&odd, (char *)buf + 8, 64), LZ_ERR_INVALID, "arena_wrap: data");
  CHECK(odd == NULL);
  CHECK_OK(lz_arena_free(lo));
  CHECK_OK(lz_arena_free(hi));
  memset(buf, 0x5a, 4096); /* still the caller's */
  CHECK_EQ_INT(lz_mem_current(LZ_MEM_ACTIVATIONS), act0);
  CHECK_OK(lz_mem_free(buf));
}
