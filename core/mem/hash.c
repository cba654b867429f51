/* hash.c — xxh64 checksums (parameters, checkpoint shards) through libxxhash:
 * one-shot, and streaming for data that arrives in pieces. */
#include "mem/lz_internal.h"

#include <stdlib.h> /* calloc, free */
#include <xxhash.h> /* XXH64, XXH64_state_t */

uint64_t lz_hash_xxh64(const void *data, size_t bytes, uint64_t seed) {
  return (uint64_t)XXH64(data, bytes, (XXH64_hash_t)seed);
}

struct lz_hasher {
  XXH64_state_t *state;
};

lz_status lz_hasher_new(lz_hasher **out, uint64_t seed) {
  if (!out) return lz_fail(LZ_ERR_INVALID, "hasher_new: out is NULL");
  *out = NULL;
  lz_hasher *h = calloc(1, sizeof *h);
  if (!h) return lz_fail(LZ_ERR_NOMEM, "hasher_new: out of memory");
  h->state = XXH64_createState();
  if (!h->state || XXH64_reset(h->state, (XXH64_hash_t)seed) != XXH_OK) {
    XXH64_freeState(h->state);
    free(h);
    return lz_fail(LZ_ERR_NOMEM, "hasher_new: cannot create an xxh64 state");
  }
  *out = h;
  return LZ_OK;
}

lz_status lz_hasher_update(lz_hasher *h, const void *data, size_t bytes) {
  if (!h || (!data && bytes)) return lz_fail(LZ_ERR_INVALID, "hasher_update: NULL argument");
  if (XXH64_update(h->state, data, bytes) != XXH_OK)
    return lz_fail(LZ_ERR_INVALID, "hasher_update: xxh64 update failed");
  return LZ_OK;
}

uint64_t lz_hasher_digest(const lz_hasher *h) {
  return h ? (uint64_t)XXH64_digest(h->state) : 0;
}

lz_status lz_hasher_free(lz_hasher *h) {
  if (!h) return LZ_OK;
  XXH64_freeState(h->state);
  free(h);
  return LZ_OK;
}
