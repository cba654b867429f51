/* hash.c — xxh64 checksums (parameters, checkpoint shards) through libxxhash. */
#include "luazero.h"

#include <xxhash.h> /* XXH64 */

uint64_t lz_hash_xxh64(const void *data, size_t bytes, uint64_t seed) {
  return (uint64_t)XXH64(data, bytes, (XXH64_hash_t)seed);
}
